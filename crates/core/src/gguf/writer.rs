//! Building GGUF v3 files.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::ggml_type::GgmlType;

use super::value::{Array, Value};
use super::{DEFAULT_ALIGNMENT, KEY_ALIGNMENT, MAGIC, MAX_ARRAY_DEPTH, MAX_DIMS};

struct WriterTensor {
    name: String,
    ty: GgmlType,
    dims: Vec<u64>,
    data: TensorData,
}

/// A tensor's bytes: given when added, or made when the file is written.
enum TensorData {
    Bytes(Vec<u8>),
    /// This many bytes, asked of the caller of [`GgufWriter::write_streaming`].
    Deferred(u64),
}

impl TensorData {
    fn len(&self) -> u64 {
        match self {
            TensorData::Bytes(b) => b.len() as u64,
            TensorData::Deferred(n) => *n,
        }
    }
}

/// What [`GgufWriter::write_streaming`] asks the bytes of: a deferred tensor's name,
/// type and dims, and where the asked part starts in its data.
#[derive(Clone, Copy, Debug)]
pub struct TensorPart<'a> {
    /// The tensor's name.
    pub name: &'a str,
    /// Its type.
    pub ty: GgmlType,
    /// Its dims, in ggml order.
    pub dims: &'a [u64],
    /// The offset of the part in the tensor's data; parts start at whole blocks.
    pub offset: u64,
}

/// Builds a GGUF v3 file in memory: metadata entries and tensors, in the order added.
///
/// Tensor data is laid out in order, each tensor starting at a multiple of the alignment
/// (32 unless set with [`GgufWriter::set_alignment`] or a `general.alignment` entry).
#[derive(Default)]
pub struct GgufWriter {
    alignment: Option<u64>,
    metadata: Vec<(String, Value)>,
    tensors: Vec<WriterTensor>,
}

impl std::fmt::Debug for GgufWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufWriter")
            .field("alignment", &self.alignment())
            .field("n_metadata", &self.metadata.len())
            .field("n_tensors", &self.tensors.len())
            .finish()
    }
}

fn invalid(what: &'static str, name: &str, reason: impl Into<String>) -> Error {
    Error::GgufWriterInvalid {
        what,
        name: name.to_string(),
        reason: reason.into(),
    }
}

impl GgufWriter {
    /// An empty writer (alignment 32).
    pub fn new() -> GgufWriter {
        GgufWriter::default()
    }

    /// The alignment of tensor data.
    pub fn alignment(&self) -> u64 {
        self.alignment.unwrap_or(DEFAULT_ALIGNMENT)
    }

    /// Sets the alignment of tensor data and records it as `general.alignment` (u32).
    /// It must be a non-zero power of two.
    pub fn set_alignment(&mut self, alignment: u32) -> Result<()> {
        if !alignment.is_power_of_two() {
            return Err(invalid(
                "metadata key",
                KEY_ALIGNMENT,
                format!("alignment {alignment} is not a non-zero power of two"),
            ));
        }
        self.alignment = Some(alignment.into());
        match self.metadata.iter_mut().find(|(k, _)| k == KEY_ALIGNMENT) {
            Some((_, v)) => *v = Value::U32(alignment),
            None => self
                .metadata
                .push((KEY_ALIGNMENT.to_string(), Value::U32(alignment))),
        }
        Ok(())
    }

    /// Adds a metadata entry. Fails if the key was already added, if arrays nest deeper than
    /// [`MAX_ARRAY_DEPTH`](super::MAX_ARRAY_DEPTH), or if the key is `general.alignment` and
    /// the value is not a power-of-two integer that fits a u32.
    pub fn add_metadata(&mut self, key: impl Into<String>, value: impl Into<Value>) -> Result<()> {
        let key = key.into();
        let value = value.into();
        if self.metadata.iter().any(|(k, _)| *k == key) {
            return Err(invalid("metadata key", &key, "added twice"));
        }
        if let Value::Array(a) = &value {
            if array_depth(a) > MAX_ARRAY_DEPTH {
                return Err(invalid(
                    "metadata key",
                    &key,
                    format!("arrays nested deeper than the limit of {MAX_ARRAY_DEPTH}"),
                ));
            }
        }
        if key == KEY_ALIGNMENT {
            match value.as_integer() {
                Some(a) if a > 0 && a <= u32::MAX as i128 && (a as u64).is_power_of_two() => {
                    self.alignment = Some(a as u64)
                }
                _ => {
                    return Err(invalid(
                        "metadata key",
                        &key,
                        format!("{value} is not a power-of-two u32 alignment"),
                    ))
                }
            }
        }
        self.metadata.push((key, value));
        Ok(())
    }

    /// Adds a tensor: `dims` in ggml order (row length first), `data` its raw bytes, whose
    /// length must be exactly what `ty` and `dims` need.
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        ty: GgmlType,
        dims: &[u64],
        data: impl Into<Vec<u8>>,
    ) -> Result<()> {
        let name = name.into();
        let data = data.into();
        let expected = self.check_tensor(&name, ty, dims)?;
        if expected != data.len() as u64 {
            return Err(invalid(
                "tensor",
                &name,
                format!(
                    "{ty} tensor of dims {dims:?} needs {expected} bytes, got {}",
                    data.len()
                ),
            ));
        }
        self.tensors.push(WriterTensor {
            name,
            ty,
            dims: dims.to_vec(),
            data: TensorData::Bytes(data),
        });
        Ok(())
    }

    /// Adds a tensor whose bytes are made when the file is written
    /// ([`GgufWriter::write_streaming`]; [`GgufWriter::to_bytes`] writes zeros for
    /// them): a file of many gigabytes is written without holding its tensors.
    pub fn add_tensor_deferred(
        &mut self,
        name: impl Into<String>,
        ty: GgmlType,
        dims: &[u64],
    ) -> Result<()> {
        let name = name.into();
        let bytes = self.check_tensor(&name, ty, dims)?;
        self.tensors.push(WriterTensor {
            name,
            ty,
            dims: dims.to_vec(),
            data: TensorData::Deferred(bytes),
        });
        Ok(())
    }

    /// Refuses a second tensor of `name` and shapes no file can hold; the bytes of one
    /// of `ty` and `dims`.
    fn check_tensor(&self, name: &str, ty: GgmlType, dims: &[u64]) -> Result<u64> {
        if self.tensors.iter().any(|t| t.name == name) {
            return Err(invalid("tensor", name, "added twice"));
        }
        if dims.len() > MAX_DIMS as usize {
            return Err(invalid(
                "tensor",
                name,
                format!("{} dimensions, more than {MAX_DIMS}", dims.len()),
            ));
        }
        super::reader::tensor_bytes(Path::new("<writer>"), name, ty, dims).map_err(|e| {
            let reason = match e {
                Error::GgufBlockMismatch { ne0, block_len, .. } => format!(
                    "{ty} rows of {ne0} values are not a multiple of the block length {block_len}"
                ),
                Error::GgufTensorSizeOverflow { what, .. } => {
                    format!("{what} of dims {dims:?} overflows 64 bits")
                }
                other => other.to_string(),
            };
            invalid("tensor", name, reason)
        })
    }

    /// Adds an F32 tensor from values (`values.len()` must be the product of `dims`).
    pub fn add_tensor_f32(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        values: &[f32],
    ) -> Result<()> {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.add_tensor(name, GgmlType::F32, dims, bytes)
    }

    /// The complete GGUF file (deferred tensors as zeros).
    pub fn to_bytes(&self) -> Vec<u8> {
        let align = self.alignment();
        let mut out = self.header();
        for t in &self.tensors {
            match &t.data {
                TensorData::Bytes(b) => out.extend_from_slice(b),
                TensorData::Deferred(n) => out.resize(out.len() + *n as usize, 0),
            }
            pad(&mut out, align);
        }
        out
    }

    /// Everything before the tensor data: magic, version, counts, metadata, tensor
    /// infos, padding to the alignment.
    fn header(&self) -> Vec<u8> {
        let align = self.alignment();
        let mut out = Vec::new();
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            put_str(&mut out, k);
            out.extend_from_slice(&v.value_type().id().to_le_bytes());
            put_value(&mut out, v);
        }
        let mut offset = 0u64;
        for t in &self.tensors {
            put_str(&mut out, &t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.ty.id().to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            offset += t.data.len().div_ceil(align) * align;
        }
        pad(&mut out, align);
        out
    }

    /// Bytes of the whole file.
    pub fn file_bytes(&self) -> u64 {
        let align = self.alignment();
        self.header().len() as u64
            + self
                .tensors
                .iter()
                .map(|t| t.data.len().div_ceil(align) * align)
                .sum::<u64>()
    }

    /// Writes the file to `path` atomically (as [`GgufWriter::write_to_file`]) without
    /// holding it in memory: `fill` is asked for each deferred tensor's bytes, in parts
    /// of at most `part_bytes` (rounded down to whole blocks), in file order.
    pub fn write_streaming(
        &self,
        path: &Path,
        part_bytes: usize,
        mut fill: impl FnMut(TensorPart<'_>, &mut [u8]) -> Result<()>,
    ) -> Result<()> {
        let align = self.alignment() as usize;
        atomic_write(path, |f| {
            let mut out = std::io::BufWriter::with_capacity(1 << 20, f);
            out.write_all(&self.header())?;
            let mut buf = Vec::new();
            for t in &self.tensors {
                let len = t.data.len();
                match &t.data {
                    TensorData::Bytes(b) => out.write_all(b)?,
                    TensorData::Deferred(n) => {
                        let block = t.ty.block_bytes().max(1);
                        let part = (part_bytes / block).max(1) * block;
                        let mut done = 0u64;
                        while done < *n {
                            let size = part.min((*n - done) as usize);
                            buf.resize(size, 0);
                            let asked = TensorPart {
                                name: &t.name,
                                ty: t.ty,
                                dims: &t.dims,
                                offset: done,
                            };
                            fill(asked, &mut buf).map_err(std::io::Error::other)?;
                            out.write_all(&buf)?;
                            done += size as u64;
                        }
                    }
                }
                let padding = (len as usize).next_multiple_of(align) - len as usize;
                out.write_all(&vec![0; padding])?;
            }
            out.flush()
        })
    }

    /// Writes the file to `path` atomically: to a temporary file in the same directory,
    /// then renamed over `path`.
    pub fn write_to_file(&self, path: &Path) -> Result<()> {
        let bytes = self.to_bytes();
        atomic_write(path, |f| f.write_all(&bytes))
    }
}

/// Runs `write` on a new temporary file beside `path`, then syncs it and renames it
/// over `path`; on failure the temporary file is removed and `path` is untouched.
fn atomic_write(
    path: &Path,
    write: impl FnOnce(&mut std::fs::File) -> std::io::Result<()>,
) -> Result<()> {
    let io = |source| Error::FileIo {
        path: path.to_path_buf(),
        source,
    };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let file_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "out.gguf".to_string());
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!(".{file_name}.tmp.{}.{n}", std::process::id()));
    let result = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)?;
        write(&mut f)?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map_err(io)
}

/// Nesting depth of an array: 1 for an array of non-arrays.
fn array_depth(a: &Array) -> usize {
    match a {
        Array::Array(v) => 1 + v.iter().map(array_depth).max().unwrap_or(0),
        _ => 1,
    }
}

fn pad(out: &mut Vec<u8>, align: u64) {
    let len = out.len() as u64;
    let target = len.div_ceil(align) * align;
    out.resize(target as usize, 0);
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(u8::from(*x)),
        Value::String(s) => put_str(out, s),
        Value::Array(a) => put_array(out, a),
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
    }
}

fn put_array(out: &mut Vec<u8>, a: &Array) {
    out.extend_from_slice(&a.elem_type().id().to_le_bytes());
    out.extend_from_slice(&(a.len() as u64).to_le_bytes());
    macro_rules! le {
        ($v:expr) => {
            for x in $v {
                out.extend_from_slice(&x.to_le_bytes());
            }
        };
    }
    match a {
        Array::U8(v) => out.extend_from_slice(v),
        Array::I8(v) => le!(v),
        Array::U16(v) => le!(v),
        Array::I16(v) => le!(v),
        Array::U32(v) => le!(v),
        Array::I32(v) => le!(v),
        Array::F32(v) => le!(v),
        Array::Bool(v) => out.extend(v.iter().map(|&b| u8::from(b))),
        Array::String(v) => v.iter().for_each(|s| put_str(out, s)),
        Array::Array(v) => v.iter().for_each(|a| put_array(out, a)),
        Array::U64(v) => le!(v),
        Array::I64(v) => le!(v),
        Array::F64(v) => le!(v),
    }
}

#[cfg(test)]
mod streaming_tests {
    use super::*;

    /// A file written in parts by `write_streaming` is the file `to_bytes` gives with
    /// the same bytes added up front, and a failed fill leaves no file behind.
    #[test]
    fn streamed_tensors_equal_tensors_given_up_front() {
        let dir = std::env::temp_dir().join(format!("gguf-stream-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let bytes_of = |name: &str, offset: u64, len: usize| -> Vec<u8> {
            (0..len)
                .map(|i| (name.len() as u64 * 31 + offset + i as u64) as u8)
                .collect()
        };
        let mut given = GgufWriter::new();
        let mut deferred = GgufWriter::new();
        for w in [&mut given, &mut deferred] {
            w.add_metadata("general.architecture", Value::String("llama".into()))
                .unwrap();
            w.add_tensor_f32("norm", &[3], &[1.0, 2.0, 3.0]).unwrap();
        }
        // 40 blocks of Q8_0 (34 bytes each), asked in parts of 3 blocks.
        let dims = [32u64, 40];
        given
            .add_tensor("m", GgmlType::Q8_0, &dims, bytes_of("m", 0, 34 * 40))
            .unwrap();
        deferred
            .add_tensor_deferred("m", GgmlType::Q8_0, &dims)
            .unwrap();
        assert!(deferred
            .add_tensor_deferred("m", GgmlType::Q8_0, &dims)
            .is_err());
        assert!(deferred
            .add_tensor_deferred("odd", GgmlType::Q8_0, &[31, 2])
            .is_err());
        let path = dir.join("m.gguf");
        let mut parts = 0;
        deferred
            .write_streaming(&path, 34 * 3 + 5, |part, buf| {
                assert_eq!(part.offset % 34, 0, "parts start at whole blocks");
                buf.copy_from_slice(&bytes_of(part.name, part.offset, buf.len()));
                parts += 1;
                Ok(())
            })
            .unwrap();
        assert_eq!(parts, 14);
        let written = std::fs::read(&path).unwrap();
        assert_eq!(written, given.to_bytes());
        assert_eq!(deferred.file_bytes(), written.len() as u64);

        let failed = dir.join("failed.gguf");
        let r = deferred.write_streaming(&failed, 1 << 20, |_, _| {
            Err(Error::InvalidArgument {
                what: "no bytes".into(),
            })
        });
        assert!(r.is_err() && !failed.exists());
        let leftovers = std::fs::read_dir(&dir).unwrap().count();
        assert_eq!(leftovers, 1, "only m.gguf");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
