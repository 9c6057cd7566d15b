//! Reading and validating GGUF files.

use std::mem::size_of;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::ggml_type::GgmlType;

use super::value::{Array, Value, ValueType};
use super::{DEFAULT_ALIGNMENT, KEY_ALIGNMENT, MAGIC, MAX_ARRAY_DEPTH, MAX_DIMS};

/// Where the bytes of an open file live.
enum Storage {
    /// Memory-mapped file.
    Mmap(memmap2::Mmap),
    /// File read into memory (or bytes handed over by the caller).
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mmap(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// Description of one tensor of a GGUF file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// Tensor name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Element type.
    pub ty: GgmlType,
    /// Dimensions in ggml order: `dims[0]` (ne0) is the row length, the fastest-varying one.
    pub dims: Vec<u64>,
    /// Absolute byte offset of the tensor's data in the file.
    pub offset: u64,
    /// Size of the tensor's data in bytes.
    pub n_bytes: u64,
}

impl TensorInfo {
    /// Number of elements (product of the dimensions; 1 for zero dimensions).
    pub fn n_elements(&self) -> u64 {
        // Checked when the file was read.
        self.dims.iter().product()
    }
}

/// A parsed, validated GGUF file (version 2 or 3, little-endian).
///
/// All lengths, counts, types, offsets and sizes were checked when it was opened, so
/// [`GgufFile::tensor_data`] cannot go out of bounds for the file's own tensors.
///
/// Opening parses in two passes: the first validates the whole header without allocating
/// anything larger than the input (only index vectors), the second builds the metadata and
/// tensor lists. A malformed file is therefore rejected before any large allocation, whatever
/// counts and lengths it claims.
pub struct GgufFile {
    /// This opened file's identity ([`crate::weights::next_file_id`]): weights read from
    /// it are known by (file id, offset), so a device keeps their copies by a key no other
    /// file can reuse.
    id: u64,
    path: PathBuf,
    storage: Storage,
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: Vec<(String, Value)>,
    tensors: Vec<TensorInfo>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("file_len", &self.file_len())
            .field("alignment", &self.alignment)
            .field("data_offset", &self.data_offset)
            .field("n_metadata", &self.metadata.len())
            .field("n_tensors", &self.tensors.len())
            .finish()
    }
}

/// The path used in errors for files read from memory.
pub const MEMORY_PATH: &str = "<memory>";

impl GgufFile {
    /// Opens and validates the GGUF file at `path`, memory-mapping it if `mmap` is true,
    /// otherwise reading it whole into memory.
    pub fn open(path: &Path, mmap: bool) -> Result<GgufFile> {
        let io = |source| Error::FileIo {
            path: path.to_path_buf(),
            source,
        };
        let storage = if mmap {
            let file = std::fs::File::open(path).map_err(io)?;
            // SAFETY: the map is read-only; like every mmap-based model loader we rely on the
            // file not being truncated or modified by another process while it is open.
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
            Storage::Mmap(map)
        } else {
            Storage::Owned(std::fs::read(path).map_err(io)?)
        };
        GgufFile::from_storage(path.to_path_buf(), storage)
    }

    /// Parses and validates a GGUF file held in memory. Errors name the file `<memory>`.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<GgufFile> {
        GgufFile::from_storage(PathBuf::from(MEMORY_PATH), Storage::Owned(bytes))
    }

    /// Parses and validates a GGUF file laid out in a read-only memory map that did not
    /// come from opening `path` (an anonymous map a compressed pack was decoded into);
    /// errors name `path`.
    pub fn from_map(path: PathBuf, map: memmap2::Mmap) -> Result<GgufFile> {
        GgufFile::from_storage(path, Storage::Mmap(map))
    }

    fn from_storage(path: PathBuf, storage: Storage) -> Result<GgufFile> {
        let parsed = parse(&path, storage.bytes())?;
        Ok(GgufFile {
            id: crate::weights::next_file_id(),
            path,
            storage,
            version: parsed.version,
            alignment: parsed.alignment,
            data_offset: parsed.data_offset,
            metadata: parsed.metadata,
            tensors: parsed.tensors,
        })
    }

    /// The identity of this opened file, unique in the process (two opens of one path
    /// are two files): the `file` half of every [`crate::weights::WeightId`] read from it.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// All the bytes of the file (memory-mapped or read into RAM).
    pub fn as_bytes(&self) -> &[u8] {
        self.storage.bytes()
    }

    /// GGUF format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The file's path (`<memory>` for [`GgufFile::from_bytes`]).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Length of the file in bytes.
    pub fn file_len(&self) -> u64 {
        self.storage.bytes().len() as u64
    }

    /// Alignment of tensor data (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute offset of the tensor data section (aligned).
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// All metadata entries, in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    /// The metadata value for `key`, if present.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// All tensor descriptions, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The tensor named `name`, or [`Error::GgufMissingTensor`].
    pub fn tensor(&self, name: &str) -> Result<&TensorInfo> {
        self.tensors
            .iter()
            .find(|t| t.name == name)
            .ok_or_else(|| Error::GgufMissingTensor {
                path: self.path.clone(),
                tensor: name.to_string(),
            })
    }

    /// The raw bytes of a tensor's data.
    ///
    /// # Panics
    /// If `info` describes a range outside this file (it cannot for infos from
    /// [`GgufFile::tensors`] of this file).
    pub fn tensor_data(&self, info: &TensorInfo) -> &[u8] {
        let start = info.offset as usize;
        &self.storage.bytes()[start..start + info.n_bytes as usize]
    }

    // ---- typed getters ----

    fn missing(&self, key: &str) -> Error {
        Error::GgufMissingKey {
            path: self.path.clone(),
            key: key.to_string(),
        }
    }

    fn wrong(&self, key: &str, expected: &'static str, found: &Value) -> Error {
        Error::GgufWrongType {
            path: self.path.clone(),
            key: key.to_string(),
            expected,
            found: found.type_description(),
        }
    }

    fn range(&self, key: &str, value: impl ToString, target: &'static str) -> Error {
        Error::GgufValueOutOfRange {
            path: self.path.clone(),
            key: key.to_string(),
            value: value.to_string(),
            target,
        }
    }

    fn require(&self, key: &str) -> Result<&Value> {
        self.get(key).ok_or_else(|| self.missing(key))
    }

    fn int_of<T: TryFrom<i128>>(&self, key: &str, v: &Value, target: &'static str) -> Result<T> {
        let i = v
            .as_integer()
            .ok_or_else(|| self.wrong(key, "integer", v))?;
        T::try_from(i).map_err(|_| self.range(key, i, target))
    }

    fn int_array_of<T: TryFrom<i128>>(
        &self,
        key: &str,
        v: &Value,
        target: &'static str,
    ) -> Result<Vec<T>> {
        let ints = v
            .as_array()
            .and_then(Array::integers)
            .ok_or_else(|| self.wrong(key, "array of integers", v))?;
        ints.into_iter()
            .map(|i| T::try_from(i).map_err(|_| self.range(key, i, target)))
            .collect()
    }

    /// `key` as a u32; accepts any integer type whose value fits.
    pub fn get_u32(&self, key: &str) -> Result<u32> {
        self.int_of(key, self.require(key)?, "u32")
    }

    /// `key` as a u64; accepts any integer type whose value fits.
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        self.int_of(key, self.require(key)?, "u64")
    }

    /// `key` as an i32; accepts any integer type whose value fits.
    pub fn get_i32(&self, key: &str) -> Result<i32> {
        self.int_of(key, self.require(key)?, "i32")
    }

    /// `key` as an f32; accepts f32 and f64 values.
    pub fn get_f32(&self, key: &str) -> Result<f32> {
        match self.require(key)? {
            Value::F32(x) => Ok(*x),
            Value::F64(x) => Ok(*x as f32),
            v => Err(self.wrong(key, "f32", v)),
        }
    }

    /// `key` as a bool.
    pub fn get_bool(&self, key: &str) -> Result<bool> {
        match self.require(key)? {
            Value::Bool(x) => Ok(*x),
            v => Err(self.wrong(key, "bool", v)),
        }
    }

    /// `key` as a string.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        let v = self.require(key)?;
        v.as_str().ok_or_else(|| self.wrong(key, "string", v))
    }

    /// `key` as an array of strings.
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>> {
        match self.require(key)? {
            Value::Array(Array::String(v)) => Ok(v.iter().map(String::as_str).collect()),
            v => Err(self.wrong(key, "array of string", v)),
        }
    }

    /// `key` as an array of i32; accepts arrays of any integer type whose values fit.
    pub fn get_i32_array(&self, key: &str) -> Result<Vec<i32>> {
        self.int_array_of(key, self.require(key)?, "i32")
    }

    /// `key` as an array of u32; accepts arrays of any integer type whose values fit.
    pub fn get_u32_array(&self, key: &str) -> Result<Vec<u32>> {
        self.int_array_of(key, self.require(key)?, "u32")
    }

    /// `key` as an array of f32; accepts arrays of f32 and f64.
    pub fn get_f32_array(&self, key: &str) -> Result<Vec<f32>> {
        match self.require(key)? {
            Value::Array(Array::F32(v)) => Ok(v.clone()),
            Value::Array(Array::F64(v)) => Ok(v.iter().map(|&x| x as f32).collect()),
            v => Err(self.wrong(key, "array of f32", v)),
        }
    }

    fn opt<'a, T>(&'a self, key: &str, f: impl FnOnce(&'a Self) -> Result<T>) -> Result<Option<T>> {
        if self.get(key).is_none() {
            Ok(None)
        } else {
            f(self).map(Some)
        }
    }

    /// Like [`GgufFile::get_u32`], but `Ok(None)` when the key is absent.
    pub fn get_u32_opt(&self, key: &str) -> Result<Option<u32>> {
        self.opt(key, |s| s.get_u32(key))
    }

    /// Like [`GgufFile::get_u64`], but `Ok(None)` when the key is absent.
    pub fn get_u64_opt(&self, key: &str) -> Result<Option<u64>> {
        self.opt(key, |s| s.get_u64(key))
    }

    /// Like [`GgufFile::get_i32`], but `Ok(None)` when the key is absent.
    pub fn get_i32_opt(&self, key: &str) -> Result<Option<i32>> {
        self.opt(key, |s| s.get_i32(key))
    }

    /// Like [`GgufFile::get_f32`], but `Ok(None)` when the key is absent.
    pub fn get_f32_opt(&self, key: &str) -> Result<Option<f32>> {
        self.opt(key, |s| s.get_f32(key))
    }

    /// Like [`GgufFile::get_bool`], but `Ok(None)` when the key is absent.
    pub fn get_bool_opt(&self, key: &str) -> Result<Option<bool>> {
        self.opt(key, |s| s.get_bool(key))
    }

    /// Like [`GgufFile::get_str`], but `Ok(None)` when the key is absent.
    pub fn get_str_opt(&self, key: &str) -> Result<Option<&str>> {
        self.opt(key, |s| s.get_str(key))
    }

    /// Like [`GgufFile::get_str_array`], but `Ok(None)` when the key is absent.
    pub fn get_str_array_opt(&self, key: &str) -> Result<Option<Vec<&str>>> {
        self.opt(key, |s| s.get_str_array(key))
    }

    /// Like [`GgufFile::get_i32_array`], but `Ok(None)` when the key is absent.
    pub fn get_i32_array_opt(&self, key: &str) -> Result<Option<Vec<i32>>> {
        self.opt(key, |s| s.get_i32_array(key))
    }

    /// Like [`GgufFile::get_u32_array`], but `Ok(None)` when the key is absent.
    pub fn get_u32_array_opt(&self, key: &str) -> Result<Option<Vec<u32>>> {
        self.opt(key, |s| s.get_u32_array(key))
    }

    /// Like [`GgufFile::get_f32_array`], but `Ok(None)` when the key is absent.
    pub fn get_f32_array_opt(&self, key: &str) -> Result<Option<Vec<f32>>> {
        self.opt(key, |s| s.get_f32_array(key))
    }
}

// ---------------------------------------------------------------------------
// Parsing
// ---------------------------------------------------------------------------

struct Parsed {
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: Vec<(String, Value)>,
    tensors: Vec<TensorInfo>,
}

/// Pushes onto a vector that will hold at most `total` items, growing it by doubling but
/// never beyond `total` (so a lying count cannot make it overshoot).
fn push_bounded<T>(v: &mut Vec<T>, item: T, total: u64) {
    if v.len() == v.capacity() {
        let left = (total as usize).saturating_sub(v.len()).max(1);
        v.reserve_exact(v.capacity().max(4).min(left));
    }
    v.push(item);
}

/// Minimum encoded size of one metadata entry: empty key, type id, one-byte value.
const MIN_KV_LEN: u64 = 8 + 4 + 1;
/// Minimum encoded size of one tensor info: empty name, n_dims, type, offset.
const MIN_TENSOR_INFO_LEN: u64 = 8 + 4 + 4 + 8;

/// A bounds-checked little-endian reader over the file bytes.
struct Cursor<'a> {
    path: &'a Path,
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(Error::GgufTruncated {
                path: self.path.to_path_buf(),
                offset: self.pos as u64,
                needed: n,
                what: what(),
            });
        }
        let start = self.pos;
        self.pos += n as usize;
        Ok(&self.bytes[start..self.pos])
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N]> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// Reads a count and checks that the remaining bytes could hold `count` items of at least
    /// `min_len` bytes each.
    fn count(&mut self, min_len: u64, what: &dyn Fn() -> String) -> Result<u64> {
        let offset = self.pos as u64;
        let count = self.u64(what)?;
        let remaining = self.remaining();
        let max = remaining / min_len.max(1);
        if count > max {
            return Err(Error::GgufCountTooLarge {
                path: self.path.to_path_buf(),
                offset,
                what: what(),
                count,
                remaining,
                max,
            });
        }
        Ok(count)
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String> {
        self.str_slice(what).map(str::to_string)
    }

    fn value_type(&mut self, what: &dyn Fn() -> String) -> Result<ValueType> {
        let offset = self.pos as u64;
        let id = self.u32(what)?;
        ValueType::from_id(id).ok_or_else(|| Error::GgufUnknownValueType {
            path: self.path.to_path_buf(),
            offset,
            what: what(),
            type_id: id,
        })
    }

    fn bool(&mut self, what: &dyn Fn() -> String) -> Result<bool> {
        let offset = self.pos as u64;
        let [b] = self.array::<1>(what)?;
        match b {
            0 => Ok(false),
            1 => Ok(true),
            value => Err(Error::GgufInvalidBool {
                path: self.path.to_path_buf(),
                offset,
                what: what(),
                value,
            }),
        }
    }

    /// Reads `n` fixed-size little-endian values (`n` already bounded by the remaining bytes).
    fn fixed<T, const N: usize>(
        &mut self,
        n: u64,
        what: &dyn Fn() -> String,
        conv: fn([u8; N]) -> T,
    ) -> Result<Vec<T>> {
        let bytes = self.take(n * N as u64, what)?;
        Ok(bytes
            .chunks_exact(N)
            .map(|c| {
                let mut a = [0u8; N];
                a.copy_from_slice(c);
                conv(a)
            })
            .collect())
    }

    fn value(&mut self, ty: ValueType, key: &str, depth: usize) -> Result<Value> {
        let what = || format!("value of metadata key '{key}'");
        let what: &dyn Fn() -> String = &what;
        Ok(match ty {
            ValueType::U8 => Value::U8(self.array::<1>(what)?[0]),
            ValueType::I8 => Value::I8(i8::from_le_bytes(self.array(what)?)),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array(what)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array(what)?)),
            ValueType::U32 => Value::U32(u32::from_le_bytes(self.array(what)?)),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array(what)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array(what)?)),
            ValueType::Bool => Value::Bool(self.bool(what)?),
            ValueType::String => Value::String(self.string(what)?),
            ValueType::Array => Value::Array(self.array_value(key, depth + 1)?),
            ValueType::U64 => Value::U64(u64::from_le_bytes(self.array(what)?)),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array(what)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array(what)?)),
        })
    }

    /// Reads the element type and length of an array, refusing nesting deeper than
    /// [`MAX_ARRAY_DEPTH`] and lengths the rest of the input cannot hold.
    fn array_header(&mut self, key: &str, depth: usize) -> Result<(ValueType, u64)> {
        if depth > MAX_ARRAY_DEPTH {
            return Err(Error::GgufNestingTooDeep {
                path: self.path.to_path_buf(),
                offset: self.pos as u64,
                key: key.to_string(),
                limit: MAX_ARRAY_DEPTH,
            });
        }
        let what = || format!("array in value of metadata key '{key}'");
        let what: &dyn Fn() -> String = &what;
        let elem = self.value_type(what)?;
        let n = self.count(elem.min_encoded_len(), what)?;
        Ok((elem, n))
    }

    /// Reads an array (element type, length, elements); `depth` is 1 for a top-level array.
    fn array_value(&mut self, key: &str, depth: usize) -> Result<Array> {
        let (elem, n) = self.array_header(key, depth)?;
        let what = || format!("array in value of metadata key '{key}'");
        let what: &dyn Fn() -> String = &what;
        // Capacity bounded so that the allocation never exceeds the remaining input.
        let cap = |size: usize| (n as usize).min(self.remaining() as usize / size.max(1));
        Ok(match elem {
            ValueType::U8 => Array::U8(self.fixed(n, what, |[b]: [u8; 1]| b)?),
            ValueType::I8 => Array::I8(self.fixed(n, what, i8::from_le_bytes)?),
            ValueType::U16 => Array::U16(self.fixed(n, what, u16::from_le_bytes)?),
            ValueType::I16 => Array::I16(self.fixed(n, what, i16::from_le_bytes)?),
            ValueType::U32 => Array::U32(self.fixed(n, what, u32::from_le_bytes)?),
            ValueType::I32 => Array::I32(self.fixed(n, what, i32::from_le_bytes)?),
            ValueType::F32 => Array::F32(self.fixed(n, what, f32::from_le_bytes)?),
            ValueType::U64 => Array::U64(self.fixed(n, what, u64::from_le_bytes)?),
            ValueType::I64 => Array::I64(self.fixed(n, what, i64::from_le_bytes)?),
            ValueType::F64 => Array::F64(self.fixed(n, what, f64::from_le_bytes)?),
            ValueType::Bool => {
                let mut v = Vec::with_capacity(cap(size_of::<bool>()));
                for _ in 0..n {
                    push_bounded(&mut v, self.bool(what)?, n);
                }
                Array::Bool(v)
            }
            ValueType::String => {
                let mut v = Vec::with_capacity(cap(size_of::<String>()));
                for _ in 0..n {
                    push_bounded(&mut v, self.string(what)?, n);
                }
                Array::String(v)
            }
            ValueType::Array => {
                let mut v = Vec::with_capacity(cap(size_of::<Array>()));
                for _ in 0..n {
                    push_bounded(&mut v, self.array_value(key, depth + 1)?, n);
                }
                Array::Array(v)
            }
        })
    }
}

/// One tensor info as validated by the first pass (nothing allocated).
struct RawTensorInfo<'a> {
    name: &'a str,
    n_dims: usize,
    dims: [u64; MAX_DIMS as usize],
    ty: GgmlType,
    rel_offset: u64,
    n_bytes: u64,
}

impl<'a> Cursor<'a> {
    /// Reads a string without copying it.
    fn str_slice(&mut self, what: &dyn Fn() -> String) -> Result<&'a str> {
        let offset = self.pos as u64;
        let len = self.u64(what)?;
        let remaining = self.remaining();
        if len > remaining {
            return Err(Error::GgufStringTooLong {
                path: self.path.to_path_buf(),
                offset,
                what: what(),
                len,
                remaining,
            });
        }
        let start = self.pos as u64;
        let bytes = self.take(len, what)?;
        std::str::from_utf8(bytes).map_err(|_| Error::GgufInvalidUtf8 {
            path: self.path.to_path_buf(),
            offset: start,
            what: what(),
        })
    }

    /// Validates a value exactly as [`Cursor::value`] would read it, without allocating.
    fn skip_value(&mut self, ty: ValueType, key: &str, depth: usize) -> Result<()> {
        let what = || format!("value of metadata key '{key}'");
        let what: &dyn Fn() -> String = &what;
        match ty {
            ValueType::Bool => {
                self.bool(what)?;
            }
            ValueType::String => {
                self.str_slice(what)?;
            }
            ValueType::Array => self.skip_array(key, depth + 1)?,
            fixed => {
                self.take(fixed.min_encoded_len(), what)?;
            }
        }
        Ok(())
    }

    /// Validates an array exactly as [`Cursor::array_value`] would read it, without allocating.
    fn skip_array(&mut self, key: &str, depth: usize) -> Result<()> {
        let (elem, n) = self.array_header(key, depth)?;
        let what = || format!("array in value of metadata key '{key}'");
        let what: &dyn Fn() -> String = &what;
        match elem {
            ValueType::Bool => {
                for _ in 0..n {
                    self.bool(what)?;
                }
            }
            ValueType::String => {
                for _ in 0..n {
                    self.str_slice(what)?;
                }
            }
            ValueType::Array => {
                for _ in 0..n {
                    self.skip_array(key, depth + 1)?;
                }
            }
            fixed => {
                self.take(n * fixed.min_encoded_len(), what)?;
            }
        }
        Ok(())
    }

    /// Reads and validates one tensor info without allocating.
    fn raw_tensor_info(&mut self, i: u64, alignment: u64) -> Result<RawTensorInfo<'a>> {
        let path = self.path;
        let name = self.str_slice(&|| format!("name of tensor {i}"))?;
        let n_dims = self.u32(&|| format!("dimension count of tensor '{name}'"))?;
        if n_dims > MAX_DIMS {
            return Err(Error::GgufTooManyDims {
                path: path.to_path_buf(),
                tensor: name.to_string(),
                n_dims,
                max: MAX_DIMS,
            });
        }
        let mut dims = [0u64; MAX_DIMS as usize];
        for d in dims.iter_mut().take(n_dims as usize) {
            *d = self.u64(&|| format!("dimensions of tensor '{name}'"))?;
        }
        let type_id = self.u32(&|| format!("type of tensor '{name}'"))?;
        let rel_offset = self.u64(&|| format!("data offset of tensor '{name}'"))?;
        let Some(ty) = GgmlType::from_id(type_id) else {
            return Err(Error::GgufUnknownTensorType {
                path: path.to_path_buf(),
                tensor: name.to_string(),
                type_id,
            });
        };
        let n_bytes = tensor_bytes(path, name, ty, &dims[..n_dims as usize])?;
        if !rel_offset.is_multiple_of(alignment) {
            return Err(Error::GgufMisalignedTensor {
                path: path.to_path_buf(),
                tensor: name.to_string(),
                offset: rel_offset,
                alignment,
            });
        }
        Ok(RawTensorInfo {
            name,
            n_dims: n_dims as usize,
            dims,
            ty,
            rel_offset,
            n_bytes,
        })
    }
}

/// Parses in two passes. The first validates the whole file (every count, length, string,
/// type, size, offset, duplicate and overlap) allocating only index vectors no larger than
/// the input; only then does the second pass build the metadata and tensor vectors. So a
/// malformed file never causes an allocation larger than itself.
fn parse(path: &Path, bytes: &[u8]) -> Result<Parsed> {
    let mut c = Cursor {
        path,
        bytes,
        pos: 0,
    };
    let p = || path.to_path_buf();

    // Header.
    let magic: [u8; 4] = c.array(&|| "magic".to_string())?;
    if magic != MAGIC {
        let mut swapped = magic;
        swapped.reverse();
        if swapped == MAGIC {
            return Err(Error::GgufBigEndian {
                path: p(),
                detail: "magic is byte-swapped (\"FUGG\")".to_string(),
            });
        }
        return Err(Error::GgufBadMagic {
            path: p(),
            found: magic,
        });
    }
    let version = c.u32(&|| "version".to_string())?;
    if version != 2 && version != 3 {
        if version & 0xffff == 0 && (1..=3).contains(&version.swap_bytes()) {
            return Err(Error::GgufBigEndian {
                path: p(),
                detail: format!(
                    "version bytes read as {version:#010x}, byte-swapped {}",
                    version.swap_bytes()
                ),
            });
        }
        return Err(Error::GgufUnsupportedVersion { path: p(), version });
    }
    let n_tensors = c.count(MIN_TENSOR_INFO_LEN, &|| "tensor".to_string())?;
    let n_kv = c.count(MIN_KV_LEN, &|| "metadata entry".to_string())?;
    let metadata_start = c.pos;

    // ---- Pass 1: metadata. Key offsets: 8 bytes per entry of at least 13 bytes.
    let mut key_offsets: Vec<usize> = Vec::with_capacity(n_kv as usize);
    let mut alignment = DEFAULT_ALIGNMENT;
    for i in 0..n_kv {
        key_offsets.push(c.pos);
        let key = c.str_slice(&|| format!("key of metadata entry {i}"))?;
        let ty = c.value_type(&|| format!("type of metadata key '{key}'"))?;
        if key == KEY_ALIGNMENT {
            alignment = read_alignment(&mut c, ty)?;
        } else {
            c.skip_value(ty, key, 0)?;
        }
    }
    let key_at = |off: usize| string_at(bytes, off);
    if let Some(key) = first_duplicate(&mut key_offsets, key_at) {
        return Err(Error::GgufDuplicateKey {
            path: p(),
            key: key.to_string(),
        });
    }
    drop(key_offsets);

    // ---- Pass 1: tensor infos. Re-check the count against what is left after the metadata.
    let remaining = c.remaining();
    if n_tensors > remaining / MIN_TENSOR_INFO_LEN {
        return Err(Error::GgufCountTooLarge {
            path: p(),
            offset: 8,
            what: "tensor".to_string(),
            count: n_tensors,
            remaining,
            max: remaining / MIN_TENSOR_INFO_LEN,
        });
    }
    let tensors_start = c.pos;
    // Name offsets: 8 bytes per tensor info of at least 24 bytes.
    let mut name_offsets: Vec<usize> = Vec::with_capacity(n_tensors as usize);
    for i in 0..n_tensors {
        name_offsets.push(c.pos);
        c.raw_tensor_info(i, alignment)?;
    }
    let header_end = c.pos as u64;
    let name_at = |off: usize| string_at(bytes, off);
    if let Some(name) = first_duplicate(&mut name_offsets, name_at) {
        return Err(Error::GgufDuplicateTensor {
            path: p(),
            tensor: name.to_string(),
        });
    }
    drop(name_offsets);

    // Data section: bounds, then overlap. Ranges: 24 bytes per tensor info of at least 24.
    let data_offset = header_end.div_ceil(alignment) * alignment;
    let file_len = bytes.len() as u64;
    let mut ranges: Vec<(u64, u64, usize)> = Vec::with_capacity(n_tensors as usize);
    c.pos = tensors_start;
    for i in 0..n_tensors {
        let t = c.raw_tensor_info(i, alignment)?;
        let start = data_offset.checked_add(t.rel_offset);
        match start.and_then(|s| s.checked_add(t.n_bytes)) {
            Some(end) if end <= file_len => {
                if t.n_bytes > 0 {
                    ranges.push((data_offset + t.rel_offset, end, ranges.len()));
                }
            }
            _ => {
                let start = data_offset.saturating_add(t.rel_offset);
                return Err(Error::GgufTensorOutOfBounds {
                    path: p(),
                    tensor: t.name.to_string(),
                    start,
                    end: start.saturating_add(t.n_bytes),
                    file_len,
                });
            }
        }
    }
    ranges.sort_unstable();
    if let Some(w) = ranges.windows(2).find(|w| w[0].1 > w[1].0) {
        // Find the names of the two overlapping tensors (by start offset).
        let (a, b) = (w[0].0, w[1].0);
        let (mut name_a, mut name_b) = (String::new(), String::new());
        c.pos = tensors_start;
        for i in 0..n_tensors {
            let t = c.raw_tensor_info(i, alignment)?;
            let start = data_offset + t.rel_offset;
            if t.n_bytes > 0 && start == a && name_a.is_empty() {
                name_a = t.name.to_string();
            } else if t.n_bytes > 0 && start == b && name_b.is_empty() {
                name_b = t.name.to_string();
            }
        }
        return Err(Error::GgufTensorOverlap {
            path: p(),
            tensor: name_b,
            other: name_a,
        });
    }
    drop(ranges);

    // ---- Pass 2: build. Everything was validated above.
    c.pos = metadata_start;
    let mut metadata = Vec::with_capacity(n_kv as usize);
    for i in 0..n_kv {
        let key = c.string(&|| format!("key of metadata entry {i}"))?;
        let ty = c.value_type(&|| format!("type of metadata key '{key}'"))?;
        let value = c.value(ty, &key, 0)?;
        metadata.push((key, value));
    }
    let mut tensors = Vec::with_capacity(n_tensors as usize);
    for i in 0..n_tensors {
        let t = c.raw_tensor_info(i, alignment)?;
        tensors.push(TensorInfo {
            name: t.name.to_string(),
            ty: t.ty,
            dims: t.dims[..t.n_dims].to_vec(),
            offset: data_offset + t.rel_offset,
            n_bytes: t.n_bytes,
        });
    }

    Ok(Parsed {
        version,
        alignment,
        data_offset,
        metadata,
        tensors,
    })
}

/// Reads the value of `general.alignment`: an integer that is a non-zero power of two
/// fitting a u32. Any other value or type is an error (nothing is allocated for it).
fn read_alignment(c: &mut Cursor<'_>, ty: ValueType) -> Result<u64> {
    let integer = matches!(
        ty,
        ValueType::U8
            | ValueType::I8
            | ValueType::U16
            | ValueType::I16
            | ValueType::U32
            | ValueType::I32
            | ValueType::U64
            | ValueType::I64
    );
    if !integer {
        return Err(Error::GgufBadAlignment {
            path: c.path.to_path_buf(),
            found: format!("of type {ty}"),
        });
    }
    let v = c.value(ty, KEY_ALIGNMENT, 0)?;
    match v.as_integer() {
        Some(a) if a > 0 && a <= u32::MAX as i128 && (a as u64).is_power_of_two() => Ok(a as u64),
        _ => Err(Error::GgufBadAlignment {
            path: c.path.to_path_buf(),
            found: format!("{ty} {v}"),
        }),
    }
}

/// The bytes of the (already validated) string whose length field is at `off`.
fn string_at(bytes: &[u8], off: usize) -> &[u8] {
    let mut len = [0u8; 8];
    len.copy_from_slice(&bytes[off..off + 8]);
    let len = u64::from_le_bytes(len) as usize;
    &bytes[off + 8..off + 8 + len]
}

/// The first repeated string (in sorted order) among the strings at `offsets`, found by
/// sorting the offsets in place: no hashing, no further allocation.
fn first_duplicate<'b>(offsets: &mut [usize], at: impl Fn(usize) -> &'b [u8]) -> Option<&'b str> {
    offsets.sort_unstable_by(|&a, &b| at(a).cmp(at(b)));
    offsets
        .windows(2)
        .find(|w| at(w[0]) == at(w[1]))
        .map(|w| std::str::from_utf8(at(w[0])).unwrap_or_default())
}

/// Byte size of a tensor, checking dims, element count overflow and block geometry.
pub(crate) fn tensor_bytes(path: &Path, name: &str, ty: GgmlType, dims: &[u64]) -> Result<u64> {
    let overflow = |what| Error::GgufTensorSizeOverflow {
        path: path.to_path_buf(),
        tensor: name.to_string(),
        dims: dims.to_vec(),
        what,
    };
    let n = dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| overflow("element count"))?;
    let ne0 = dims.first().copied().unwrap_or(1);
    let block_len = ty.block_len();
    if !ne0.is_multiple_of(block_len as u64) {
        return Err(Error::GgufBlockMismatch {
            path: path.to_path_buf(),
            tensor: name.to_string(),
            ty,
            ne0,
            block_len,
        });
    }
    ty.bytes_for(n).ok_or_else(|| overflow("byte size"))
}
