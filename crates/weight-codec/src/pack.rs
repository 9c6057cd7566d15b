//! The pack file: a GGUF model with each tensor coded on its own, chunk by chunk.
//!
//! ```text
//! offset  size  field
//! 0       8     magic "BALLPACK"
//! 8       4     version (1, or 2 when a chunk uses coder 3, `rans-lanes`, which
//!               version 1 readers do not know), u32 little-endian like every integer
//! 12      4     CRC-32 of bytes 16 .. data start (the rest of the header, the GGUF
//!               header and the index)
//! 16      8     length of the embedded GGUF header (the source file up to its data
//!               section: metadata, tensor table, alignment padding)
//! 24      8     length of the GGUF file the pack decodes to
//! 32      8     length of the index
//! 40      8     length of the data section
//! 48      16    reserved (zero)
//! 64            the GGUF header, then the index, then the data section (the chunks)
//!
//! index:  u32 tensor count, then per tensor:
//!         u16 name length, name, u32 ggml type, u64 offset in the GGUF file,
//!         u64 raw length, u8 codec (the tensor's choice: transform in the high
//!         nibble, 0 none, 1 planes; coder in the low one, 0 raw, 1 zstd, 2 rans,
//!         3 rans-lanes since version 2), u32 raw bytes per chunk,
//!         u32 chunk count, then per chunk: u64 offset in the data section,
//!         u32 stored length, u8 codec (the tensor's, or raw where coding expanded
//!         it), u32 CRC-32 of the raw bytes, u32 CRC-32 of the stored bytes
//! ```
//!
//! [`PackFile::open`] checks every length, offset and count against the file and the
//! embedded GGUF header before using it; a chunk is checked against the CRC of its
//! stored bytes before it is decoded and against the CRC of its raw bytes after, so a
//! changed byte gives [`Error::Corrupt`] naming the tensor and chunk, never wrong
//! weights. [`write_pack`] writes a temporary file beside the target and renames it, so
//! a pack is either complete or absent.

use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use ballast_core::ggml_type::GgmlType;
use ballast_core::gguf::GgufFile;

use crate::codec::{self, Codec, Coder};
use crate::error::{Corruption, Error, Result};

/// The first bytes of every pack.
pub const MAGIC: [u8; 8] = *b"BALLPACK";
/// The newest format version this crate writes and reads (it reads every version from
/// 1; it writes 1 unless a chunk needs 2).
pub const VERSION: u32 = 2;
/// The version that added coder 3 (`rans-lanes`).
const VERSION_RANS_LANES: u32 = 2;
const FIXED_HEADER: u64 = 64;
const CHUNK_RECORD: u64 = 8 + 4 + 1 + 4 + 4;
/// Largest raw chunk accepted (the writer's chunks are far smaller).
pub const MAX_CHUNK_RAW: u32 = 64 << 20;

/// Whether the file at `path` starts with the pack magic (false if it cannot be read).
pub fn is_pack(path: &Path) -> bool {
    use std::io::Read;
    let mut head = [0u8; 8];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut head))
        .is_ok()
        && head == MAGIC
}

/// One chunk of a packed tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    /// Offset of the stored bytes in the data section.
    pub offset: u64,
    /// Stored (coded) length.
    pub stored_len: u32,
    /// Raw (decoded) length.
    pub raw_len: u32,
    /// Codec of this chunk.
    pub codec: Codec,
    /// CRC-32 of the raw bytes.
    pub raw_crc: u32,
    /// CRC-32 of the stored bytes.
    pub stored_crc: u32,
}

/// One tensor of a pack.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PackedTensor {
    /// GGUF name.
    pub name: String,
    /// Element type.
    pub ty: GgmlType,
    /// Offset of its data in the GGUF file the pack decodes to.
    pub gguf_offset: u64,
    /// Raw bytes.
    pub raw_len: u64,
    /// The codec chosen for the tensor.
    pub codec: Codec,
    /// Raw bytes per chunk (the last may be shorter).
    pub chunk_raw: u32,
    /// The chunks, in order.
    pub chunks: Vec<Chunk>,
}

impl PackedTensor {
    /// Bytes stored for the tensor.
    pub fn stored_len(&self) -> u64 {
        self.chunks.iter().map(|c| c.stored_len as u64).sum()
    }

    /// Raw bytes over stored bytes.
    pub fn ratio(&self) -> f64 {
        self.raw_len as f64 / self.stored_len().max(1) as f64
    }
}

enum Storage {
    /// The map and the file it maps, kept open to see whether the file was cut short
    /// while mapped ([`PackFile::check_mapped_len`]).
    Mmap {
        map: memmap2::Mmap,
        file: std::fs::File,
    },
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mmap { map, .. } => map,
            Storage::Owned(v) => v,
        }
    }
}

/// An opened, validated pack.
pub struct PackFile {
    path: PathBuf,
    storage: Storage,
    /// Set by [`PackFile::read_chunks_from_disk`]: chunks are read with `pread` and
    /// their page-cache pages dropped after, instead of through the map.
    chunk_reader: std::sync::OnceLock<std::fs::File>,
    gguf_header: std::ops::Range<usize>,
    gguf_len: u64,
    data_start: usize,
    tensors: Vec<PackedTensor>,
}

impl std::fmt::Debug for PackFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackFile")
            .field("path", &self.path)
            .field("len", &self.file_len())
            .field("gguf_len", &self.gguf_len)
            .field("n_tensors", &self.tensors.len())
            .finish()
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
    path: &'a Path,
}

impl Reader<'_> {
    fn take(&mut self, n: usize, what: &str) -> Result<&[u8]> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len());
        let Some(end) = end else {
            return Err(Error::BadIndex {
                path: self.path.to_path_buf(),
                detail: format!("the index ends inside {what}"),
            });
        };
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.take(1, what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16> {
        let b = self.take(2, what)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes(b.try_into().expect("4 bytes")))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        let b = self.take(8, what)?;
        Ok(u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }
}

fn le_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
fn le_u64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// An anonymous, lazily zeroed map of `len` bytes: pages cost memory only once written.
fn zeroed_map(path: &Path, len: u64) -> Result<memmap2::MmapMut> {
    let len = usize::try_from(len.max(1)).map_err(|_| Error::BadIndex {
        path: path.to_path_buf(),
        detail: format!("GGUF length {len} does not fit in memory"),
    })?;
    memmap2::MmapMut::map_anon(len).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })
}

impl PackFile {
    /// Opens and validates the pack at `path`, memory-mapping it if `mmap` is true,
    /// otherwise reading it into memory.
    pub fn open(path: &Path, mmap: bool) -> Result<PackFile> {
        let io = |source| Error::Io {
            path: path.to_path_buf(),
            source,
        };
        let storage = if mmap {
            let file = std::fs::File::open(path).map_err(io)?;
            // SAFETY: read-only map. Another process may still rewrite or cut the file
            // while it is open: a changed chunk is caught by its checksums, and a file
            // cut short by `check_mapped_len` before each chunk is read through the map
            // (a read past the new end would raise SIGBUS), which leaves only a cut
            // between that check and the read unguarded.
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
            Storage::Mmap { map, file }
        } else {
            Storage::Owned(std::fs::read(path).map_err(io)?)
        };
        PackFile::from_storage(path.to_path_buf(), storage)
    }

    /// Parses and validates a pack held in memory; errors name the file `<memory>`.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<PackFile> {
        PackFile::from_storage(PathBuf::from("<memory>"), Storage::Owned(bytes))
    }

    fn from_storage(path: PathBuf, storage: Storage) -> Result<PackFile> {
        let b = storage.bytes();
        let len = b.len() as u64;
        let truncated = |what: &str, needed: u64| Error::Truncated {
            path: path.clone(),
            what: what.to_string(),
            needed,
            len,
        };
        if b.len() < 8 || b[..8] != MAGIC {
            return Err(Error::NotAPack {
                path,
                found: b[..b.len().min(8)].to_vec(),
            });
        }
        if len < FIXED_HEADER {
            return Err(truncated("the fixed header", FIXED_HEADER));
        }
        let version = le_u32(b, 8);
        if !(1..=VERSION).contains(&version) {
            return Err(Error::UnsupportedVersion {
                path,
                version,
                known: VERSION,
            });
        }
        let (gh_len, gguf_len, index_len, data_len) =
            (le_u64(b, 16), le_u64(b, 24), le_u64(b, 32), le_u64(b, 40));
        let index_start = FIXED_HEADER
            .checked_add(gh_len)
            .ok_or_else(|| truncated("the GGUF header", u64::MAX))?;
        if index_start > len {
            return Err(truncated("the GGUF header", index_start));
        }
        let data_start = index_start
            .checked_add(index_len)
            .ok_or_else(|| truncated("the index", u64::MAX))?;
        if data_start > len {
            return Err(truncated("the index", data_start));
        }
        let end = data_start
            .checked_add(data_len)
            .ok_or_else(|| truncated("the data section", u64::MAX))?;
        if end > len {
            return Err(truncated("the data section", end));
        }
        if end < len {
            return Err(Error::BadIndex {
                path,
                detail: format!("{} bytes after the data section", len - end),
            });
        }
        let (index_start, data_start) = (index_start as usize, data_start as usize);
        let expected = le_u32(b, 12);
        let found = crc32fast::hash(&b[16..data_start]);
        if expected != found {
            return Err(Error::HeaderChecksum {
                path,
                expected,
                found,
            });
        }
        let tensors = parse_index(&path, &b[index_start..data_start], data_len)?;
        let pack = PackFile {
            path,
            gguf_header: FIXED_HEADER as usize..index_start,
            gguf_len,
            data_start,
            tensors,
            storage,
            chunk_reader: std::sync::OnceLock::new(),
        };
        pack.check_against_gguf()?;
        Ok(pack)
    }

    /// The embedded GGUF header must describe exactly the tensors of the index.
    fn check_against_gguf(&self) -> Result<()> {
        let gguf = self.gguf_with(|_| false, 1)?;
        let bad = |detail: String| Error::BadIndex {
            path: self.path.clone(),
            detail,
        };
        if gguf.data_offset() != self.gguf_header.len() as u64 {
            return Err(bad(format!(
                "the GGUF header is {} bytes but its data section starts at {}",
                self.gguf_header.len(),
                gguf.data_offset()
            )));
        }
        if gguf.tensors().len() != self.tensors.len() {
            return Err(bad(format!(
                "the GGUF header lists {} tensors, the index {}",
                gguf.tensors().len(),
                self.tensors.len()
            )));
        }
        for (g, t) in gguf.tensors().iter().zip(&self.tensors) {
            if g.name != t.name
                || g.ty != t.ty
                || g.offset != t.gguf_offset
                || g.n_bytes != t.raw_len
            {
                return Err(bad(format!(
                    "tensor {} of the index ({}, {} bytes at {}) differs from the GGUF header's {} ({}, {} bytes at {})",
                    t.name, t.ty, t.raw_len, t.gguf_offset, g.name, g.ty, g.n_bytes, g.offset
                )));
            }
        }
        Ok(())
    }

    /// The file's path (`<memory>` for [`PackFile::from_bytes`]).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Length of the pack in bytes.
    pub fn file_len(&self) -> u64 {
        self.storage.bytes().len() as u64
    }

    /// Length of the GGUF file the pack decodes to.
    pub fn gguf_len(&self) -> u64 {
        self.gguf_len
    }

    /// The tensors, in GGUF order.
    pub fn tensors(&self) -> &[PackedTensor] {
        &self.tensors
    }

    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Result<&PackedTensor> {
        self.tensors
            .iter()
            .find(|t| t.name == name)
            .ok_or_else(|| Error::NoSuchTensor {
                path: self.path.clone(),
                name: name.to_string(),
            })
    }

    /// From now on, reads each chunk's stored bytes with `pread` and then tells the
    /// kernel to drop them from the page cache (`POSIX_FADV_DONTNEED`), instead of
    /// reading them through the memory map. For a pack streamed from disk under a
    /// memory limit: through the map, readahead and the page cache's own choices
    /// under the limit made a token read about twice the stored bytes.
    pub fn read_chunks_from_disk(&self) -> Result<()> {
        if self.chunk_reader.get().is_some() || matches!(self.storage, Storage::Owned(_)) {
            return Ok(());
        }
        let file = std::fs::File::open(&self.path).map_err(|source| Error::Io {
            path: self.path.clone(),
            source,
        })?;
        // Chunks are read whole, each once per use: readahead past a chunk's end would
        // only fill the page cache with the next layer's bytes, which the limit then
        // evicts before they are used.
        // SAFETY: `posix_fadvise` only reads its integer arguments on an open descriptor;
        // a failure leaves the default readahead, which is harmless.
        unsafe {
            libc::posix_fadvise(
                std::os::unix::io::AsRawFd::as_raw_fd(&file),
                0,
                0,
                libc::POSIX_FADV_RANDOM,
            );
        }
        let _ = self.chunk_reader.set(file);
        Ok(())
    }

    /// An error naming the file if it is mapped and has been cut shorter than the map
    /// since it was opened: reading the map past the file's new end would raise SIGBUS
    /// instead of an error. One `fstat`, done before chunks are read through the map.
    pub fn check_mapped_len(&self) -> Result<()> {
        let Storage::Mmap { map, file } = &self.storage else {
            return Ok(());
        };
        let len = file
            .metadata()
            .map_err(|source| Error::Io {
                path: self.path.clone(),
                source,
            })?
            .len();
        if len < map.len() as u64 {
            return Err(Error::Truncated {
                path: self.path.clone(),
                what: "the open memory map (the file was cut short while in use)".into(),
                needed: map.len() as u64,
                len,
            });
        }
        Ok(())
    }

    /// The stored bytes of `chunk`: borrowed from the map or memory, or read from the
    /// file (see [`PackFile::read_chunks_from_disk`]).
    fn stored_bytes(&self, chunk: &Chunk) -> Result<std::borrow::Cow<'_, [u8]>> {
        self.stored_span(chunk.offset, chunk.stored_len as usize)
    }

    /// `len` stored bytes from `offset` of the data section (the chunks there, one after
    /// another): borrowed from the map or memory, or read from the file in one read.
    /// The span must lie within chunks whose ranges were checked at open.
    pub fn stored_span(&self, offset: u64, len: usize) -> Result<std::borrow::Cow<'_, [u8]>> {
        let mut buf = Vec::new();
        match self.stored_span_in(offset, len, &mut buf)? {
            Some(bytes) => Ok(std::borrow::Cow::Borrowed(bytes)),
            None => Ok(std::borrow::Cow::Owned(buf)),
        }
    }

    /// [`PackFile::stored_span`] into `buf` (reused across calls, so a reader keeps one
    /// buffer instead of the allocator keeping every span it freed): `Some` borrows the
    /// bytes from the map or memory and leaves `buf` alone; `None` means they were read
    /// from the file into `buf`, which then holds exactly them.
    pub fn stored_span_in<'a>(
        &'a self,
        offset: u64,
        len: usize,
        buf: &mut Vec<u8>,
    ) -> Result<Option<&'a [u8]>> {
        let Some(file) = self.chunk_reader.get() else {
            self.check_mapped_len()?;
            let start = self.data_start + offset as usize;
            let all = self.storage.bytes();
            let bytes = all
                .get(start..start + len)
                .ok_or_else(|| Error::Truncated {
                    path: self.path.clone(),
                    what: format!("{len} stored bytes at {offset} of the data section"),
                    needed: (start + len) as u64,
                    len: all.len() as u64,
                })?;
            return Ok(Some(bytes));
        };
        use std::os::unix::fs::FileExt;
        use std::os::unix::io::AsRawFd;
        let at = (self.data_start as u64) + offset;
        buf.clear();
        buf.resize(len, 0);
        file.read_exact_at(buf, at).map_err(|source| Error::Io {
            path: self.path.clone(),
            source,
        })?;
        // SAFETY: `posix_fadvise` only reads its integer arguments; the descriptor is
        // open for the call's duration. A failure is harmless (the pages stay cached).
        unsafe {
            libc::posix_fadvise(
                file.as_raw_fd(),
                at as libc::off_t,
                len as libc::off_t,
                libc::POSIX_FADV_DONTNEED,
            );
        }
        Ok(None)
    }

    /// The stored bytes of `chunk` (its range was checked when the pack was opened).
    pub fn stored(&self, chunk: &Chunk) -> &[u8] {
        let start = self.data_start + chunk.offset as usize;
        &self.storage.bytes()[start..start + chunk.stored_len as usize]
    }

    /// Chunk `index` of `tensor`, or an error naming both.
    pub fn chunk<'t>(&self, tensor: &'t PackedTensor, index: usize) -> Result<&'t Chunk> {
        tensor.chunks.get(index).ok_or_else(|| Error::BadIndex {
            path: self.path.clone(),
            detail: format!("tensor {} has no chunk {index}", tensor.name),
        })
    }

    /// The error for chunk `index` of `tensor`.
    fn corrupt(&self, tensor: &PackedTensor, index: usize, kind: Corruption) -> Error {
        Error::Corrupt {
            path: self.path.clone(),
            tensor: tensor.name.clone(),
            chunk: index,
            kind,
        }
    }

    /// `stored` (chunk `index` of `tensor`) checked against its CRC-32.
    fn check_stored(&self, tensor: &PackedTensor, index: usize, stored: &[u8]) -> Result<()> {
        let c = self.chunk(tensor, index)?;
        let found = crc32fast::hash(stored);
        if found != c.stored_crc {
            return Err(self.corrupt(
                tensor,
                index,
                Corruption::StoredChecksum {
                    expected: c.stored_crc,
                    found,
                },
            ));
        }
        Ok(())
    }

    /// The stored bytes of chunk `index` of `tensor` (through the map), checked against
    /// their CRC-32: what a device that decodes the chunk itself is lent.
    pub fn checked_stored(&self, tensor: &PackedTensor, index: usize) -> Result<&[u8]> {
        self.check_mapped_len()?;
        let stored = self.stored(self.chunk(tensor, index)?);
        self.check_stored(tensor, index, stored)?;
        Ok(stored)
    }

    /// Chunk `index` of `tensor`'s stored bytes as they are in the pack, read now (the
    /// coded form a caller may hold and decode later with [`PackFile::decode_stored`]).
    pub fn read_stored(&self, tensor: &PackedTensor, index: usize) -> Result<Vec<u8>> {
        Ok(self.stored_bytes(self.chunk(tensor, index)?)?.into_owned())
    }

    /// Decodes chunk `index` of `tensor` into `out` (its raw length), checking both
    /// checksums.
    pub fn decode_chunk(&self, tensor: &PackedTensor, index: usize, out: &mut [u8]) -> Result<()> {
        let chunk = self.chunk(tensor, index)?;
        let stored = self.stored_bytes(chunk)?;
        self.decode_stored(tensor, index, &stored, out)
    }

    /// Decodes `stored`, the stored bytes of chunk `index` of `tensor` (held by the
    /// caller), into `out` (its raw length), checking both checksums.
    pub fn decode_stored(
        &self,
        tensor: &PackedTensor,
        index: usize,
        stored: &[u8],
        out: &mut [u8],
    ) -> Result<()> {
        let c = self.chunk(tensor, index)?;
        if out.len() != c.raw_len as usize {
            return Err(self.corrupt(
                tensor,
                index,
                Corruption::Length {
                    expected: c.raw_len as usize,
                    got: out.len(),
                },
            ));
        }
        // Stored bytes of another length fail their checksum.
        self.check_stored(tensor, index, stored)?;
        codec::decode_chunk(tensor.ty, c.codec, stored, out)
            .map_err(|kind| self.corrupt(tensor, index, kind))?;
        let found = crc32fast::hash(out);
        if found != c.raw_crc {
            return Err(self.corrupt(
                tensor,
                index,
                Corruption::DecodedChecksum {
                    expected: c.raw_crc,
                    found,
                },
            ));
        }
        Ok(())
    }

    /// Decodes `tensor` into `out` (its raw length) on up to `threads` threads, chunks
    /// split between them.
    pub fn decode_tensor(
        &self,
        tensor: &PackedTensor,
        out: &mut [u8],
        threads: usize,
    ) -> Result<()> {
        if out.len() as u64 != tensor.raw_len {
            return Err(Error::InvalidOption(format!(
                "decoding {}: buffer of {} bytes for {} raw bytes",
                tensor.name,
                out.len(),
                tensor.raw_len
            )));
        }
        let step = tensor.chunk_raw.max(1) as usize;
        let pieces: Vec<(usize, &mut [u8])> = out.chunks_mut(step).enumerate().collect();
        run_split(pieces, threads, |(i, piece)| {
            self.decode_chunk(tensor, i, piece)
        })
    }

    /// The GGUF file this pack decodes to, laid out in an anonymous map named after the
    /// pack: the tensors for which `decode` is true are decoded (on `threads` threads),
    /// the others left as zeros that take no memory until written.
    pub fn gguf_with(
        &self,
        decode: impl Fn(&PackedTensor) -> bool,
        threads: usize,
    ) -> Result<GgufFile> {
        let mut map = zeroed_map(&self.path, self.gguf_len)?;
        self.check_mapped_len()?;
        let header = &self.storage.bytes()[self.gguf_header.clone()];
        if header.len() as u64 > self.gguf_len {
            return Err(Error::BadIndex {
                path: self.path.clone(),
                detail: format!(
                    "GGUF header of {} bytes is longer than the GGUF file ({} bytes)",
                    header.len(),
                    self.gguf_len
                ),
            });
        }
        map[..header.len()].copy_from_slice(header);
        let mut jobs: Vec<(&PackedTensor, &mut [u8])> = Vec::new();
        let mut rest: &mut [u8] = &mut map[..];
        let mut base = 0u64;
        let mut order: Vec<&PackedTensor> = self.tensors.iter().filter(|t| decode(t)).collect();
        order.sort_by_key(|t| t.gguf_offset);
        for t in order {
            let end = t
                .gguf_offset
                .checked_add(t.raw_len)
                .filter(|&e| e <= self.gguf_len);
            if t.gguf_offset < base || end.is_none() {
                return Err(Error::BadIndex {
                    path: self.path.clone(),
                    detail: format!(
                        "tensor {} overlaps another or lies outside the GGUF file",
                        t.name
                    ),
                });
            }
            let tail = std::mem::take(&mut rest);
            let (_, tail) = tail.split_at_mut((t.gguf_offset - base) as usize);
            let (dst, tail) = tail.split_at_mut(t.raw_len as usize);
            jobs.push((t, dst));
            rest = tail;
            base = t.gguf_offset + t.raw_len;
        }
        // Chunks of every tensor are one job list, so small tensors share threads too.
        let mut pieces: Vec<(&PackedTensor, usize, &mut [u8])> = Vec::new();
        for (t, dst) in jobs {
            for (i, piece) in dst.chunks_mut(t.chunk_raw.max(1) as usize).enumerate() {
                pieces.push((t, i, piece));
            }
        }
        run_split(pieces, threads, |(t, i, piece)| {
            self.decode_chunk(t, i, piece)
        })?;
        let map = map.make_read_only().map_err(|source| Error::Io {
            path: self.path.clone(),
            source,
        })?;
        Ok(GgufFile::from_map(self.path.clone(), map)?)
    }

    /// The whole GGUF file this pack decodes to.
    pub fn to_gguf(&self, threads: usize) -> Result<GgufFile> {
        self.gguf_with(|_| true, threads)
    }
}

/// Runs `f` over `items` on up to `threads` scoped threads (contiguous shares), and
/// returns the first error.
pub(crate) fn run_split<T: Send>(
    items: Vec<T>,
    threads: usize,
    f: impl Fn(T) -> Result<()> + Sync,
) -> Result<()> {
    let threads = threads.clamp(1, items.len().max(1));
    if threads == 1 {
        return items.into_iter().try_for_each(f);
    }
    let per = items.len().div_ceil(threads);
    let mut groups: Vec<Vec<T>> = Vec::new();
    let mut it = items.into_iter().peekable();
    while it.peek().is_some() {
        groups.push(it.by_ref().take(per).collect());
    }
    let f = &f;
    std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|g| s.spawn(move || g.into_iter().try_for_each(f)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect::<Result<Vec<()>>>()
            .map(|_| ())
    })
}

fn parse_index(path: &Path, bytes: &[u8], data_len: u64) -> Result<Vec<PackedTensor>> {
    let bad = |detail: String| Error::BadIndex {
        path: path.to_path_buf(),
        detail,
    };
    let mut r = Reader { bytes, at: 0, path };
    let n = r.u32("the tensor count")? as usize;
    // Each tensor takes at least 35 bytes of index: refuse counts the index cannot hold
    // before allocating for them.
    if n > bytes.len() / 35 {
        return Err(bad(format!(
            "{n} tensors cannot fit in an index of {} bytes",
            bytes.len()
        )));
    }
    let mut tensors = Vec::with_capacity(n);
    for k in 0..n {
        let name_len = r.u16(&format!("the name of tensor #{k}"))? as usize;
        let name = String::from_utf8(r.take(name_len, "a tensor name")?.to_vec())
            .map_err(|_| bad(format!("the name of tensor #{k} is not UTF-8")))?;
        let ty_id = r.u32(&format!("the type of {name}"))?;
        let ty = GgmlType::from_id(ty_id)
            .ok_or_else(|| bad(format!("tensor {name} has unknown ggml type {ty_id}")))?;
        let gguf_offset = r.u64(&format!("the offset of {name}"))?;
        let raw_len = r.u64(&format!("the length of {name}"))?;
        let codec_id = r.u8(&format!("the codec of {name}"))?;
        let codec = Codec::from_id(codec_id)
            .ok_or_else(|| bad(format!("tensor {name} has unknown codec {codec_id:#04x}")))?;
        let chunk_raw = r.u32(&format!("the chunk length of {name}"))?;
        let n_chunks = r.u32(&format!("the chunk count of {name}"))? as u64;
        if chunk_raw == 0 || chunk_raw > MAX_CHUNK_RAW {
            return Err(bad(format!(
                "tensor {name} has chunks of {chunk_raw} bytes"
            )));
        }
        if n_chunks != raw_len.div_ceil(chunk_raw as u64) {
            return Err(bad(format!(
                "tensor {name} of {raw_len} bytes in chunks of {chunk_raw} has {n_chunks} chunks"
            )));
        }
        if n_chunks > (bytes.len() - r.at) as u64 / CHUNK_RECORD {
            return Err(bad(format!(
                "tensor {name}: {n_chunks} chunks overrun the index"
            )));
        }
        let mut chunks = Vec::with_capacity(n_chunks as usize);
        for i in 0..n_chunks {
            let offset = r.u64("a chunk offset")?;
            let stored_len = r.u32("a chunk length")?;
            let cid = r.u8("a chunk codec")?;
            let raw_crc = r.u32("a chunk checksum")?;
            let stored_crc = r.u32("a chunk checksum")?;
            let codec = Codec::from_id(cid).ok_or_else(|| {
                bad(format!(
                    "tensor {name}, chunk {i}: unknown codec {cid:#04x}"
                ))
            })?;
            if offset
                .checked_add(stored_len as u64)
                .is_none_or(|e| e > data_len)
            {
                return Err(bad(format!(
                    "tensor {name}, chunk {i}: {stored_len} bytes at {offset} lie outside the data section ({data_len} bytes)"
                )));
            }
            let raw = (raw_len - i * chunk_raw as u64).min(chunk_raw as u64) as u32;
            if codec.coder == Coder::Raw && stored_len != raw {
                return Err(bad(format!(
                    "tensor {name}, chunk {i}: stored raw with {stored_len} bytes for {raw}"
                )));
            }
            chunks.push(Chunk {
                offset,
                stored_len,
                raw_len: raw,
                codec,
                raw_crc,
                stored_crc,
            });
        }
        tensors.push(PackedTensor {
            name,
            ty,
            gguf_offset,
            raw_len,
            codec,
            chunk_raw,
            chunks,
        });
    }
    if r.at != bytes.len() {
        return Err(bad(format!(
            "{} bytes after the last tensor of the index",
            bytes.len() - r.at
        )));
    }
    Ok(tensors)
}

/// How [`write_pack`] codes a model.
#[derive(Clone, Debug)]
pub struct PackOptions {
    /// Raw bytes per chunk (rounded down to whole blocks of each tensor's type).
    pub chunk_bytes: usize,
    /// zstd compression level.
    pub zstd_level: i32,
    /// Codecs tried on each tensor; the smallest wins.
    pub candidates: Vec<Codec>,
    /// Threads that code chunks.
    pub threads: usize,
}

impl Default for PackOptions {
    fn default() -> PackOptions {
        PackOptions {
            chunk_bytes: 256 << 10,
            zstd_level: 9,
            candidates: Codec::CANDIDATES.to_vec(),
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        }
    }
}

/// What [`write_pack`] did with one tensor.
#[derive(Clone, Debug)]
pub struct TensorReport {
    /// GGUF name.
    pub name: String,
    /// Element type.
    pub ty: GgmlType,
    /// Raw bytes.
    pub raw_len: u64,
    /// Stored bytes with each candidate codec (raw chunks where coding expanded one).
    pub candidates: Vec<(Codec, u64)>,
    /// The codec kept.
    pub chosen: Codec,
}

impl TensorReport {
    /// Bytes stored for the chosen codec.
    pub fn stored_len(&self) -> u64 {
        self.candidates
            .iter()
            .find(|(c, _)| *c == self.chosen)
            .map_or(self.raw_len, |(_, n)| *n)
    }
}

/// Progress of [`write_pack`], handed to its callback after each tensor.
#[derive(Clone, Debug)]
pub struct Progress<'a> {
    /// The tensor just coded.
    pub tensor: &'a str,
    /// Raw bytes coded so far.
    pub done: u64,
    /// Raw bytes in all.
    pub total: u64,
}

struct Coded {
    chunks: Vec<(Vec<u8>, Codec, u32)>,
}

fn code_tensor(ty: GgmlType, raw: &[u8], codec: Codec, opts: &PackOptions) -> Coded {
    let step = codec::chunk_len(ty, opts.chunk_bytes);
    let pieces: Vec<&[u8]> = raw.chunks(step).collect();
    let coded = std::sync::Mutex::new(vec![None; pieces.len()]);
    let items: Vec<(usize, &[u8])> = pieces.into_iter().enumerate().collect();
    run_split(items, opts.threads, |(i, piece)| {
        let mut out = Vec::new();
        codec::encode_chunk(ty, codec, opts.zstd_level, piece, &mut out);
        let entry = if out.len() >= piece.len() {
            (piece.to_vec(), Codec::RAW, crc32fast::hash(piece))
        } else {
            (out, codec, crc32fast::hash(piece))
        };
        coded.lock().unwrap_or_else(|p| p.into_inner())[i] = Some(entry);
        Ok(())
    })
    .expect("coding a chunk cannot fail");
    Coded {
        chunks: coded
            .into_inner()
            .unwrap_or_else(|p| p.into_inner())
            .into_iter()
            .map(|c| c.expect("every chunk coded"))
            .collect(),
    }
}

/// Packs the GGUF file `input` into a pack at `out`, trying each candidate codec on
/// each tensor and keeping the smallest. Written to a temporary file beside `out`,
/// then renamed over it. Returns what was done with each tensor.
pub fn write_pack(
    input: &GgufFile,
    out: &Path,
    opts: &PackOptions,
    progress: &mut dyn FnMut(&Progress<'_>),
) -> Result<Vec<TensorReport>> {
    if opts.candidates.is_empty()
        || opts.chunk_bytes == 0
        || opts.chunk_bytes > MAX_CHUNK_RAW as usize
    {
        return Err(Error::InvalidOption(format!(
            "packing needs at least one codec and chunks of 1..={MAX_CHUNK_RAW} bytes (got {} codecs, {} bytes)",
            opts.candidates.len(),
            opts.chunk_bytes
        )));
    }
    let bytes = input.as_bytes();
    let data_offset = input.data_offset() as usize;
    check_padding(input)?;
    let header = &bytes[..data_offset];
    let tensors = input.tensors();
    let mut index_len = 4u64;
    for t in tensors {
        let step = codec::chunk_len(t.ty, opts.chunk_bytes) as u64;
        index_len += 2 + t.name.len() as u64 + 4 + 8 + 8 + 1 + 4 + 4;
        index_len += t.n_bytes.div_ceil(step) * CHUNK_RECORD;
    }
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| Error::Io { path, source }
    };
    let tmp = out.with_file_name(format!(
        ".{}.tmp-{}",
        out.file_name()
            .map_or("pack".into(), |n| n.to_string_lossy()),
        std::process::id()
    ));
    let result = (|| -> Result<Vec<TensorReport>> {
        let mut f = std::io::BufWriter::new(std::fs::File::create(&tmp).map_err(io(&tmp))?);
        let data_start = FIXED_HEADER + header.len() as u64 + index_len;
        f.seek(SeekFrom::Start(data_start)).map_err(io(&tmp))?;
        let total: u64 = tensors.iter().map(|t| t.n_bytes).sum();
        let mut done = 0u64;
        let mut data_len = 0u64;
        let mut index = Vec::with_capacity(index_len as usize);
        index.extend((tensors.len() as u32).to_le_bytes());
        let mut reports = Vec::new();
        let mut lanes_used = false;
        for t in tensors {
            let raw = input.tensor_data(t);
            let mut best: Option<(Codec, Coded, u64)> = None;
            let mut sizes = Vec::new();
            for &c in &opts.candidates {
                let coded = code_tensor(t.ty, raw, c, opts);
                let size: u64 = coded.chunks.iter().map(|(b, _, _)| b.len() as u64).sum();
                sizes.push((c, size));
                if best.as_ref().is_none_or(|(_, _, s)| size < *s) {
                    best = Some((c, coded, size));
                }
            }
            let (chosen, coded, _) = best.expect("at least one candidate");
            let step = codec::chunk_len(t.ty, opts.chunk_bytes);
            let name_len = u16::try_from(t.name.len())
                .map_err(|_| Error::InvalidOption(format!("tensor name {} is too long", t.name)))?;
            index.extend(name_len.to_le_bytes());
            index.extend(t.name.as_bytes());
            index.extend(t.ty.id().to_le_bytes());
            index.extend(t.offset.to_le_bytes());
            index.extend(t.n_bytes.to_le_bytes());
            index.push(chosen.id());
            index.extend((step as u32).to_le_bytes());
            index.extend((coded.chunks.len() as u32).to_le_bytes());
            for (stored, codec, raw_crc) in &coded.chunks {
                lanes_used |= codec.coder == Coder::RansLanes;
                index.extend(data_len.to_le_bytes());
                index.extend((stored.len() as u32).to_le_bytes());
                index.push(codec.id());
                index.extend(raw_crc.to_le_bytes());
                index.extend(crc32fast::hash(stored).to_le_bytes());
                f.write_all(stored).map_err(io(&tmp))?;
                data_len += stored.len() as u64;
            }
            reports.push(TensorReport {
                name: t.name.clone(),
                ty: t.ty,
                raw_len: t.n_bytes,
                candidates: sizes,
                chosen,
            });
            done += t.n_bytes;
            progress(&Progress {
                tensor: &t.name,
                done,
                total,
            });
        }
        debug_assert_eq!(index.len() as u64, index_len);
        let mut head = Vec::with_capacity(FIXED_HEADER as usize);
        head.extend(MAGIC);
        // Packs without lane-coded chunks stay readable by version 1 readers.
        let version = if lanes_used { VERSION_RANS_LANES } else { 1 };
        head.extend(version.to_le_bytes());
        head.extend([0u8; 4]); // the checksum, below
        head.extend((header.len() as u64).to_le_bytes());
        head.extend(input.file_len().to_le_bytes());
        head.extend(index_len.to_le_bytes());
        head.extend(data_len.to_le_bytes());
        head.resize(FIXED_HEADER as usize, 0);
        let mut crc = crc32fast::Hasher::new();
        crc.update(&head[16..]);
        crc.update(header);
        crc.update(&index);
        head[12..16].copy_from_slice(&crc.finalize().to_le_bytes());
        f.seek(SeekFrom::Start(0)).map_err(io(&tmp))?;
        f.write_all(&head).map_err(io(&tmp))?;
        f.write_all(header).map_err(io(&tmp))?;
        f.write_all(&index).map_err(io(&tmp))?;
        let file = f.into_inner().map_err(|e| Error::Io {
            path: tmp.clone(),
            source: e.into_error(),
        })?;
        file.sync_all().map_err(io(&tmp))?;
        Ok(reports)
    })();
    match result {
        Ok(reports) => {
            std::fs::rename(&tmp, out).map_err(io(out))?;
            Ok(reports)
        }
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// The pack does not store the bytes between tensors: they must be zero.
fn check_padding(input: &GgufFile) -> Result<()> {
    let bytes = input.as_bytes();
    let mut spans: Vec<(u64, u64)> = input
        .tensors()
        .iter()
        .map(|t| (t.offset, t.n_bytes))
        .collect();
    spans.sort();
    let mut at = input.data_offset();
    let check = |from: u64, to: u64| -> Result<()> {
        if from >= to {
            return Ok(());
        }
        if let Some(k) = bytes[from as usize..to as usize]
            .iter()
            .position(|&b| b != 0)
        {
            return Err(Error::NonZeroPadding {
                path: input.path().to_path_buf(),
                offset: from + k as u64 - input.data_offset(),
            });
        }
        Ok(())
    };
    for (off, n) in spans {
        check(at, off)?;
        at = at.max(off + n);
    }
    check(at, input.file_len())
}

/// Measures decoding `pack`'s tensors of type `ty` (all if `None`) on `threads`
/// threads: raw bytes per second of wall time, over at least `min_secs` seconds.
pub fn decode_speed(
    pack: &PackFile,
    ty: Option<GgmlType>,
    threads: usize,
    min_secs: f64,
) -> Result<f64> {
    let tensors: Vec<&PackedTensor> = pack
        .tensors()
        .iter()
        .filter(|t| ty.is_none_or(|ty| t.ty == ty))
        .collect();
    let max = tensors.iter().map(|t| t.raw_len).max().unwrap_or(0) as usize;
    let mut buf = vec![0u8; max];
    let start = Instant::now();
    let mut bytes = 0u64;
    loop {
        for t in &tensors {
            pack.decode_tensor(t, &mut buf[..t.raw_len as usize], threads)?;
            bytes += t.raw_len;
        }
        if tensors.is_empty() || start.elapsed().as_secs_f64() >= min_secs {
            break;
        }
    }
    Ok(bytes as f64 / start.elapsed().as_secs_f64().max(1e-9))
}
