//! The neuron file, `MODEL.neurons` beside the model: every MLP neuron's record
//! ([`NeuronLayout`]: the up row as stored, the down column as Q8_0), so that one read
//! fetches one neuron and a run of adjacent neurons is one read.
//!
//! Layout (little-endian):
//!
//! | bytes | what |
//! |---|---|
//! | 8 | magic `BLSTNRNS` |
//! | 4 | version (1) |
//! | 8 | model fingerprint ([`ballast_core::fingerprint::model_fingerprint`]) |
//! | 4 × 6 | layers, neurons per layer, width, up type id, down type id, record bytes |
//! | 4 | CRC-32 of the 44 bytes before it |
//! | (layers × neurons) × (record + 4) | per layer, per neuron: the record, then the CRC-32 of (layer `u32`, neuron `u32`, record) |
//!
//! Every read checks each record's CRC-32 (a damaged or misplaced record is
//! [`Error::DamagedRecord`], naming the file, layer and neuron); opening checks the
//! header's and refuses a file for another model, of another layout, or of the wrong
//! length.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use ballast_core::ggml_type::GgmlType;
use ballast_core::neurons::NeuronLayout;

use crate::source::{check_read, NeuronSource};
use crate::{Error, Result};

const MAGIC: &[u8; 8] = b"BLSTNRNS";
const VERSION: u32 = 1;
/// Header bytes, its CRC-32 included.
pub const HEADER_BYTES: usize = 48;

/// What a neuron file holds, from its header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NeuronFileHeader {
    /// The model's fingerprint.
    pub fingerprint: u64,
    /// Layers.
    pub n_layers: usize,
    /// Neurons per layer.
    pub n_ff: usize,
    /// The records' layout.
    pub layout: NeuronLayout,
}

impl NeuronFileHeader {
    /// Bytes of one record and its CRC-32.
    pub fn stride(&self) -> usize {
        self.layout.record_bytes() + 4
    }

    /// The whole file's length.
    pub fn file_len(&self) -> u64 {
        // Saturating: a damaged header's counts must not overflow (it is refused by
        // its length instead).
        (self.n_layers as u64)
            .saturating_mul(self.n_ff as u64)
            .saturating_mul(self.stride() as u64)
            .saturating_add(HEADER_BYTES as u64)
    }

    /// The header's bytes.
    pub fn to_bytes(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[..8].copy_from_slice(MAGIC);
        b[8..12].copy_from_slice(&VERSION.to_le_bytes());
        b[12..20].copy_from_slice(&self.fingerprint.to_le_bytes());
        let fields = [
            self.n_layers as u32,
            self.n_ff as u32,
            self.layout.n_embd as u32,
            self.layout.up_type.id(),
            self.layout.down_type.id(),
            self.layout.record_bytes() as u32,
        ];
        for (i, f) in fields.iter().enumerate() {
            b[20 + 4 * i..24 + 4 * i].copy_from_slice(&f.to_le_bytes());
        }
        let crc = crc32fast::hash(&b[..44]);
        b[44..48].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Parses a header, checking magic, version, checksum and that its layout is one.
    pub fn from_bytes(b: &[u8], path: &Path) -> Result<NeuronFileHeader> {
        let bad = |why: String| Error::NeuronFile {
            path: path.to_path_buf(),
            why,
        };
        if b.len() < HEADER_BYTES {
            return Err(bad(format!(
                "truncated: {} bytes, shorter than the {HEADER_BYTES}-byte header",
                b.len()
            )));
        }
        if &b[..8] != MAGIC {
            return Err(bad("not a neuron file (bad magic)".into()));
        }
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
        if crc32fast::hash(&b[..44]) != u32_at(44) {
            return Err(bad("the header is damaged (checksum mismatch)".into()));
        }
        let version = u32_at(8);
        if version != VERSION {
            return Err(bad(format!(
                "version {version}; this build reads version {VERSION}"
            )));
        }
        let ty =
            |id: u32| GgmlType::from_id(id).ok_or_else(|| bad(format!("unknown type id {id}")));
        let layout = NeuronLayout {
            n_embd: u32_at(28) as usize,
            up_type: ty(u32_at(32))?,
            down_type: ty(u32_at(36))?,
        };
        layout.check().map_err(|e| bad(e.to_string()))?;
        if layout.record_bytes() != u32_at(40) as usize {
            return Err(bad(format!(
                "records of {} bytes in a layout of {}",
                u32_at(40),
                layout.record_bytes()
            )));
        }
        Ok(NeuronFileHeader {
            fingerprint: u64::from_le_bytes(b[12..20].try_into().expect("8 bytes")),
            n_layers: u32_at(20) as usize,
            n_ff: u32_at(24) as usize,
            layout,
        })
    }
}

/// The CRC-32 of neuron `neuron` of `layer` with record `record`.
fn record_crc(layer: usize, neuron: usize, record: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&(layer as u32).to_le_bytes());
    h.update(&(neuron as u32).to_le_bytes());
    h.update(record);
    h.finalize()
}

/// `MODEL.neurons` for the model at `model`.
pub fn neuron_file_path(model: &Path) -> PathBuf {
    let mut name = model.as_os_str().to_owned();
    name.push(".neurons");
    PathBuf::from(name)
}

/// Writes a neuron file layer by layer into `PATH.tmp`, renamed to `PATH` by
/// [`NeuronFileWriter::finish`] (so a file at `PATH` is always whole).
pub struct NeuronFileWriter {
    header: NeuronFileHeader,
    path: PathBuf,
    tmp: PathBuf,
    file: std::io::BufWriter<File>,
    layers_written: usize,
}

impl NeuronFileWriter {
    /// Starts the file of `header` at `path`.
    pub fn create(path: &Path, header: NeuronFileHeader) -> Result<NeuronFileWriter> {
        header.layout.check()?;
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".tmp");
        let tmp = PathBuf::from(tmp);
        let io = |source| Error::Io {
            path: tmp.clone(),
            source,
        };
        let mut file = std::io::BufWriter::new(File::create(&tmp).map_err(io)?);
        file.write_all(&header.to_bytes()).map_err(io)?;
        Ok(NeuronFileWriter {
            header,
            path: path.to_path_buf(),
            tmp,
            file,
            layers_written: 0,
        })
    }

    /// Appends the next layer's records ([`crate::layer_records`]: `n_ff` records).
    pub fn write_layer(&mut self, records: &[u8]) -> Result<()> {
        let rb = self.header.layout.record_bytes();
        if records.len() != self.header.n_ff * rb || self.layers_written >= self.header.n_layers {
            return Err(Error::InvalidArgument {
                what: format!(
                    "layer {} of {} with {} bytes of records (want {})",
                    self.layers_written,
                    self.header.n_layers,
                    records.len(),
                    self.header.n_ff * rb
                ),
            });
        }
        let layer = self.layers_written;
        let io = |source| Error::Io {
            path: self.tmp.clone(),
            source,
        };
        for (j, record) in records.chunks_exact(rb).enumerate() {
            self.file.write_all(record).map_err(io)?;
            self.file
                .write_all(&record_crc(layer, j, record).to_le_bytes())
                .map_err(io)?;
        }
        self.layers_written += 1;
        Ok(())
    }

    /// Flushes, syncs and renames the file into place; every layer must be written.
    pub fn finish(self) -> Result<()> {
        let io = |source| Error::Io {
            path: self.tmp.clone(),
            source,
        };
        if self.layers_written != self.header.n_layers {
            return Err(Error::InvalidArgument {
                what: format!(
                    "a neuron file of {} layers finished after {}",
                    self.header.n_layers, self.layers_written
                ),
            });
        }
        let file = self.file.into_inner().map_err(|e| io(e.into_error()))?;
        file.sync_all().map_err(io)?;
        std::fs::rename(&self.tmp, &self.path).map_err(|source| Error::Io {
            path: self.path.clone(),
            source,
        })
    }
}

/// An open neuron file: a [`NeuronSource`] reading records with `pread`, a run of
/// adjacent neurons in one read, every record's CRC-32 checked.
pub struct NeuronFile {
    path: PathBuf,
    file: File,
    header: NeuronFileHeader,
}

impl NeuronFile {
    /// Opens `path` for the model of `fingerprint` with `n_layers` layers of `n_ff`
    /// neurons of width `n_embd` whose `ffn_up` is of `up_type`: anything else, a
    /// damaged header or a length other than the header's is refused.
    pub fn open(
        path: &Path,
        fingerprint: u64,
        n_layers: usize,
        n_ff: usize,
        n_embd: usize,
        up_type: GgmlType,
    ) -> Result<NeuronFile> {
        let io = |source| Error::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        let mut head = vec![0u8; HEADER_BYTES.min(len as usize)];
        file.read_exact_at(&mut head, 0).map_err(io)?;
        let header = NeuronFileHeader::from_bytes(&head, path)?;
        let bad = |why: String| Error::NeuronFile {
            path: path.to_path_buf(),
            why,
        };
        if header.fingerprint != fingerprint {
            return Err(bad(format!(
                "made for another model (fingerprint {:016x}, this model's is {fingerprint:016x}): make it again with `ballast sparsify --neurons`",
                header.fingerprint
            )));
        }
        if (
            header.n_layers,
            header.n_ff,
            header.layout.n_embd,
            header.layout.up_type,
        ) != (n_layers, n_ff, n_embd, up_type)
        {
            return Err(bad(format!(
                "{} layers of {} neurons of width {} with {:?} up rows; the model has {n_layers} of {n_ff} of width {n_embd} with {up_type:?}",
                header.n_layers, header.n_ff, header.layout.n_embd, header.layout.up_type
            )));
        }
        if len != header.file_len() {
            return Err(bad(format!(
                "{} bytes, the header says {} (truncated or extended)",
                len,
                header.file_len()
            )));
        }
        Ok(NeuronFile {
            path: path.to_path_buf(),
            file,
            header,
        })
    }

    /// The header.
    pub fn header(&self) -> &NeuronFileHeader {
        &self.header
    }
}

impl NeuronSource for NeuronFile {
    fn layout(&self) -> NeuronLayout {
        self.header.layout
    }

    fn n_layers(&self) -> usize {
        self.header.n_layers
    }

    fn n_ff(&self) -> usize {
        self.header.n_ff
    }

    fn read(&self, layer: usize, neurons: &[u32], out: &mut Vec<u8>) -> Result<u64> {
        check_read(layer, neurons, self.header.n_layers, self.header.n_ff)?;
        let (stride, rb) = (self.header.stride(), self.header.layout.record_bytes());
        let layer_start = HEADER_BYTES as u64 + (layer * self.header.n_ff) as u64 * stride as u64;
        let mut buf = Vec::new();
        let mut read = 0u64;
        let mut i = 0;
        while i < neurons.len() {
            // A run of adjacent neurons: one read.
            let first = neurons[i] as usize;
            let mut end = i + 1;
            while end < neurons.len() && neurons[end] as usize == first + (end - i) {
                end += 1;
            }
            let run = end - i;
            buf.resize(run * stride, 0);
            self.file
                .read_exact_at(&mut buf, layer_start + (first * stride) as u64)
                .map_err(|source| Error::Io {
                    path: self.path.clone(),
                    source,
                })?;
            read += buf.len() as u64;
            for (r, chunk) in buf.chunks_exact(stride).enumerate() {
                let (record, crc) = chunk.split_at(rb);
                if record_crc(layer, first + r, record)
                    != u32::from_le_bytes(crc.try_into().expect("4 bytes"))
                {
                    return Err(Error::DamagedRecord {
                        path: self.path.clone(),
                        layer,
                        neuron: first + r,
                    });
                }
                out.extend_from_slice(record);
            }
            i = end;
        }
        Ok(read)
    }
}
