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
    data: Vec<u8>,
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
        if self.tensors.iter().any(|t| t.name == name) {
            return Err(invalid("tensor", &name, "added twice"));
        }
        if dims.len() > MAX_DIMS as usize {
            return Err(invalid(
                "tensor",
                &name,
                format!("{} dimensions, more than {MAX_DIMS}", dims.len()),
            ));
        }
        let expected = super::reader::tensor_bytes(Path::new("<writer>"), &name, ty, dims)
            .map_err(|e| {
                let reason = match e {
                    Error::GgufBlockMismatch { ne0, block_len, .. } => format!(
                        "{ty} rows of {ne0} values are not a multiple of the block length {block_len}"
                    ),
                    Error::GgufTensorSizeOverflow { what, .. } => {
                        format!("{what} of dims {dims:?} overflows 64 bits")
                    }
                    other => other.to_string(),
                };
                invalid("tensor", &name, reason)
            })?;
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
            data,
        });
        Ok(())
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

    /// The complete GGUF file.
    pub fn to_bytes(&self) -> Vec<u8> {
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
            offset += (t.data.len() as u64).div_ceil(align) * align;
        }
        pad(&mut out, align);
        for t in &self.tensors {
            out.extend_from_slice(&t.data);
            pad(&mut out, align);
        }
        out
    }

    /// Writes the file to `path` atomically: to a temporary file in the same directory,
    /// then renamed over `path`.
    pub fn write_to_file(&self, path: &Path) -> Result<()> {
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
            f.write_all(&self.to_bytes())?;
            f.sync_all()?;
            drop(f);
            std::fs::rename(&tmp, path)
        })();
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        result.map_err(io)
    }
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
