//! The neuron file, `MODEL.neurons` beside the model: every MLP neuron's record
//! ([`NeuronLayout`]: the up row as stored, the down column as Q8_0), so that one read
//! fetches one neuron and a run of neurons stored side by side is one read.
//!
//! Each layer's records are stored in the order the writer is given: neuron order
//! (`ballast sparsify --neurons`), or hot first (`--neuron-order hot`: PowerInfer's hot
//! neurons, by how often each was active on the calibration text, [`hot_first`]). Hot
//! first was measured to read more 4 KiB pages than neuron order on SmolLM2 (the
//! hottest neurons stay in the neuron cache; the misses come as runs of adjacent ids),
//! so it is not the default. The order changes where a record sits, never what it
//! holds: results do not depend on it.
//!
//! Layout (little-endian), version 3:
//!
//! | bytes | what |
//! |---|---|
//! | 8 | magic `BLSTNRNS` |
//! | 4 | version (3) |
//! | 8 | model fingerprint ([`ballast_core::fingerprint::model_fingerprint`]) |
//! | 4 × 6 | layers, neurons per layer, width, up type id, down type id, record bytes |
//! | 4 | CRC-32 of the 44 bytes before it |
//! | layers × (neurons × 4 + 4) | per layer, its order (the neuron `u32` stored at each place, a permutation of the layer's neurons), then the CRC-32 of (layer `u32`, the order's bytes) |
//! | to the next multiple of 4096 | zeros |
//! | layers × section | per layer, its records section, starting on a multiple of 4096: per place, the record of the neuron the order puts there, then the CRC-32 of (layer `u32`, neuron `u32`, record): a *stride* of record bytes + 4 |
//!
//! In a records section, when the stride is at most 4096, the records sit `per_page =
//! ⌊4096 / stride⌋` to a 4 KiB page: place `p` at byte `(p / per_page) × 4096 + (p %
//! per_page) × stride` of the section, the rest of each page zeros, the section
//! `⌈neurons / per_page⌉` whole pages. So no record and its CRC-32 crosses a page
//! boundary of the file, and one neuron read through the page cache, or from storage out
//! of core, touches one page, not two (back to back, records of 976 bytes on SmolLM2 cross
//! one in four times). When the stride is over 4096, the records are back to back from
//! the section's start, and the section is padded to whole pages: a record then spans
//! `⌈stride / 4096⌉` pages or one more, and starting each on a page would save at most
//! that one page at the cost of padding every record to whole pages (for a stride just
//! over 4096, nearly doubling the file, and reading the padding in every run of
//! adjacent records). [`NeuronFileHeader::record_offset`] gives where a record sits.
//! The padding holds nothing and is not checked (a damaged padding byte changes no
//! record); the file's length is.
//!
//! Version 2 (the files of earlier builds) is the same without the padding: the records
//! follow the orders, back to back. Version 1 has no order section either and stores
//! each layer's records in neuron order. Both are still read, as their layouts say.
//! Every read checks each record's CRC-32 (a damaged or misplaced record is
//! [`Error::DamagedRecord`], naming the file, layer and neuron); opening checks the
//! header's and every order's (a damaged order, or one that is not a permutation, is
//! refused naming the layer), and refuses a file for another model, of another layout,
//! or of the wrong length.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use ballast_core::ggml_type::GgmlType;
use ballast_core::neurons::NeuronLayout;

use crate::source::{check_read, NeuronSource};
use crate::{Error, Result};

const MAGIC: &[u8; 8] = b"BLSTNRNS";
/// The version this build writes; it reads it and versions 1 and 2.
pub const NEURON_FILE_VERSION: u32 = 3;
/// Header bytes, its CRC-32 included.
pub const HEADER_BYTES: usize = 48;
/// The page a record of a version 3 file does not cross.
const PAGE: u64 = 4096;

/// `x` rounded up to a whole number of pages (saturating).
fn page_up(x: u64) -> u64 {
    x.div_ceil(PAGE).saturating_mul(PAGE)
}

/// What a neuron file holds, from its header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NeuronFileHeader {
    /// The format version: [`NEURON_FILE_VERSION`], 2 (records back to back, no
    /// padding) or 1 (records in neuron order, no order section either).
    pub version: u32,
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

    /// Bytes of one layer's order and its CRC-32 (none in version 1).
    fn order_bytes(&self) -> u64 {
        if self.version == 1 {
            0
        } else {
            (self.n_ff as u64).saturating_mul(4).saturating_add(4)
        }
    }

    // The sizes below saturate: a damaged header's counts must not overflow (it is
    // refused by its length instead).

    /// Where the orders end: after the header and every layer's order.
    fn orders_end(&self) -> u64 {
        (self.n_layers as u64)
            .saturating_mul(self.order_bytes())
            .saturating_add(HEADER_BYTES as u64)
    }

    /// Records (and their CRC-32) per 4 KiB page: in version 3 with a stride of at most
    /// 4096 bytes; `None` when they are back to back.
    fn per_page(&self) -> Option<u64> {
        let stride = self.stride() as u64;
        (self.version >= 3 && stride <= PAGE).then(|| PAGE / stride)
    }

    /// Bytes of one layer's records section (in version 3, whole pages).
    fn section_bytes(&self) -> u64 {
        let n_ff = self.n_ff as u64;
        match self.per_page() {
            Some(per_page) => n_ff.div_ceil(per_page).saturating_mul(PAGE),
            None if self.version >= 3 => page_up(n_ff.saturating_mul(self.stride() as u64)),
            None => n_ff.saturating_mul(self.stride() as u64),
        }
    }

    /// Where the records start: after the header and the orders (in version 3, at the
    /// next multiple of 4096).
    pub fn records_start(&self) -> u64 {
        if self.version >= 3 {
            page_up(self.orders_end())
        } else {
            self.orders_end()
        }
    }

    /// Where the record (then its CRC-32) at place `place` of layer `layer` starts.
    pub fn record_offset(&self, layer: usize, place: usize) -> u64 {
        let place = place as u64;
        let in_section = match self.per_page() {
            Some(per_page) => (place / per_page)
                .saturating_mul(PAGE)
                .saturating_add((place % per_page) * self.stride() as u64),
            None => place.saturating_mul(self.stride() as u64),
        };
        (layer as u64)
            .saturating_mul(self.section_bytes())
            .saturating_add(self.records_start())
            .saturating_add(in_section)
    }

    /// The whole file's length.
    pub fn file_len(&self) -> u64 {
        (self.n_layers as u64)
            .saturating_mul(self.section_bytes())
            .saturating_add(self.records_start())
    }

    /// The header's bytes.
    pub fn to_bytes(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[..8].copy_from_slice(MAGIC);
        b[8..12].copy_from_slice(&self.version.to_le_bytes());
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
        if version == 0 || version > NEURON_FILE_VERSION {
            return Err(bad(format!(
                "version {version}; this build reads versions 1 to {NEURON_FILE_VERSION}: make it again with `ballast sparsify --neurons`"
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
            version,
            fingerprint: u64::from_le_bytes(b[12..20].try_into().expect("8 bytes")),
            n_layers: u32_at(20) as usize,
            n_ff: u32_at(24) as usize,
            layout,
        })
    }
}

/// A layer's hot-first order from how often each neuron was active
/// ([`crate::Calibration::active_counts`]): the neurons by count, most first, ties in
/// neuron order (so counts all equal give neuron order).
pub fn hot_first(counts: &[u64]) -> Vec<u32> {
    let mut order: Vec<u32> = (0..counts.len() as u32).collect();
    // Stable: ties keep neuron order.
    order.sort_by_key(|&j| std::cmp::Reverse(counts[j as usize]));
    order
}

/// The CRC-32 of layer `layer`'s order `order` (its bytes as stored).
fn order_crc(layer: usize, order: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&(layer as u32).to_le_bytes());
    h.update(order);
    h.finalize()
}

/// Whether `order` holds each of `0..order.len()` once.
fn is_permutation(order: &[u32]) -> bool {
    let mut seen = vec![false; order.len()];
    order.iter().all(|&n| {
        let fresh = seen.get(n as usize) == Some(&false);
        if fresh {
            seen[n as usize] = true;
        }
        fresh
    })
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
    /// Per layer, the neuron at each place.
    orders: Vec<Vec<u32>>,
    path: PathBuf,
    tmp: PathBuf,
    file: std::io::BufWriter<File>,
    /// Bytes written so far.
    written: u64,
    layers_written: usize,
}

impl NeuronFileWriter {
    /// Starts the file of `header` (of version [`NEURON_FILE_VERSION`]) at `path`, each
    /// layer's records to be stored in the order of `orders` (per layer, the neuron at
    /// each place: a permutation of `0..n_ff`).
    pub fn create(
        path: &Path,
        header: NeuronFileHeader,
        orders: Vec<Vec<u32>>,
    ) -> Result<NeuronFileWriter> {
        header.layout.check()?;
        let invalid = |what: String| Err(Error::InvalidArgument { what });
        if header.version != NEURON_FILE_VERSION {
            return invalid(format!(
                "this build writes neuron files of version {NEURON_FILE_VERSION}, not {}",
                header.version
            ));
        }
        if orders.len() != header.n_layers {
            return invalid(format!(
                "{} neuron orders for {} layers",
                orders.len(),
                header.n_layers
            ));
        }
        if let Some(l) = orders
            .iter()
            .position(|o| o.len() != header.n_ff || !is_permutation(o))
        {
            return invalid(format!(
                "layer {l}'s neuron order is not a permutation of its {} neurons",
                header.n_ff
            ));
        }
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".tmp");
        let tmp = PathBuf::from(tmp);
        let io = |source| Error::Io {
            path: tmp.clone(),
            source,
        };
        let file = std::io::BufWriter::new(File::create(&tmp).map_err(io)?);
        let mut w = NeuronFileWriter {
            header,
            orders: Vec::new(),
            path: path.to_path_buf(),
            tmp,
            file,
            written: 0,
            layers_written: 0,
        };
        w.put(&header.to_bytes())?;
        for (l, order) in orders.iter().enumerate() {
            let bytes: Vec<u8> = order.iter().flat_map(|n| n.to_le_bytes()).collect();
            w.put(&bytes)?;
            w.put(&order_crc(l, &bytes).to_le_bytes())?;
        }
        w.pad_to(header.records_start())?;
        w.orders = orders;
        Ok(w)
    }

    /// Writes `bytes`.
    fn put(&mut self, bytes: &[u8]) -> Result<()> {
        self.file.write_all(bytes).map_err(|source| Error::Io {
            path: self.tmp.clone(),
            source,
        })?;
        self.written += bytes.len() as u64;
        Ok(())
    }

    /// Writes zeros up to byte `at` of the file.
    fn pad_to(&mut self, at: u64) -> Result<()> {
        const ZEROS: [u8; PAGE as usize] = [0; PAGE as usize];
        debug_assert!(at >= self.written, "the layout places nothing backwards");
        while self.written < at {
            let n = (at - self.written).min(PAGE) as usize;
            self.put(&ZEROS[..n])?;
        }
        Ok(())
    }

    /// Appends the next layer's records ([`crate::layer_records`]: `n_ff` records in
    /// neuron order), stored in the layer's order.
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
        for place in 0..self.header.n_ff {
            let j = self.orders[layer][place] as usize;
            let record = &records[j * rb..][..rb];
            self.pad_to(self.header.record_offset(layer, place))?;
            self.put(record)?;
            self.put(&record_crc(layer, j, record).to_le_bytes())?;
        }
        // The section's padding: the next layer's starts on a page (version 3).
        self.pad_to(self.header.record_offset(layer + 1, 0))?;
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
        debug_assert_eq!(self.written, self.header.file_len());
        let file = self.file.into_inner().map_err(|e| io(e.into_error()))?;
        file.sync_all().map_err(io)?;
        std::fs::rename(&self.tmp, &self.path).map_err(|source| Error::Io {
            path: self.path.clone(),
            source,
        })
    }
}

/// An open neuron file: a [`NeuronSource`] reading records with `pread`, a run of
/// records adjacent in the file in one read, every record's CRC-32 checked. The bytes a
/// read returns are the bytes it read, the padding inside a run included.
pub struct NeuronFile {
    path: PathBuf,
    file: File,
    header: NeuronFileHeader,
    /// Per layer (`n_ff` each), each neuron's place in the layer's records.
    place: Vec<u32>,
}

impl NeuronFile {
    /// Opens `path` for the model of `fingerprint` with `n_layers` layers of `n_ff`
    /// neurons of width `n_embd` whose `ffn_up` is of `up_type`: anything else, a
    /// damaged header or order, or a length other than the header's is refused.
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
        // The orders: read whole (the length check above bounds them by the file).
        let mut place = vec![0u32; n_layers * n_ff];
        if header.version == 1 {
            for row in place.chunks_exact_mut(n_ff) {
                for (j, p) in row.iter_mut().enumerate() {
                    *p = j as u32;
                }
            }
        } else {
            let mut orders = vec![0u8; (header.orders_end() - HEADER_BYTES as u64) as usize];
            file.read_exact_at(&mut orders, HEADER_BYTES as u64)
                .map_err(io)?;
            for (l, (section, row)) in orders
                .chunks_exact(n_ff * 4 + 4)
                .zip(place.chunks_exact_mut(n_ff))
                .enumerate()
            {
                let (bytes, crc) = section.split_at(n_ff * 4);
                if order_crc(l, bytes) != u32::from_le_bytes(crc.try_into().expect("4 bytes")) {
                    return Err(bad(format!(
                        "layer {l}'s neuron order is damaged (checksum mismatch)"
                    )));
                }
                let order: Vec<u32> = bytes
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
                    .collect();
                if !is_permutation(&order) {
                    return Err(bad(format!(
                        "layer {l}'s neuron order is not a permutation of its {n_ff} neurons"
                    )));
                }
                for (p, &j) in order.iter().enumerate() {
                    row[j as usize] = p as u32;
                }
            }
        }
        // Reads are a few records at a time, scattered: without this hint the kernel's
        // readahead turns each into a read of 128 KiB or more, which under a memory
        // limit is read again and again (measured: 80 MiB of storage reads per token
        // where 4-15 MiB of records were asked for).
        {
            use std::os::unix::io::AsRawFd;
            // SAFETY: the descriptor belongs to `file`, open for the whole call; the
            // call only sets the kernel's access pattern for it.
            let _ = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_RANDOM) };
        }
        Ok(NeuronFile {
            path: path.to_path_buf(),
            file,
            header,
            place,
        })
    }

    /// The header.
    pub fn header(&self) -> &NeuronFileHeader {
        &self.header
    }

    /// The order of `layer`'s records: the neuron at each place (neuron order for a
    /// version 1 file).
    pub fn order(&self, layer: usize) -> Option<Vec<u32>> {
        let n_ff = self.header.n_ff;
        let place = self.place.get(layer * n_ff..(layer + 1) * n_ff)?;
        let mut order = vec![0u32; n_ff];
        for (j, &p) in place.iter().enumerate() {
            order[p as usize] = j as u32;
        }
        Some(order)
    }

    /// Reads the records of `neurons` of `layer` into `out` (appended, in the order
    /// asked): the asked neurons sorted by place, each run of adjacent places one read
    /// (in version 3, with the padding between them, skipped).
    fn read_records(&self, layer: usize, neurons: &[u32], out: &mut Vec<u8>) -> Result<u64> {
        let (h, rb, n_ff) = (
            &self.header,
            self.header.layout.record_bytes(),
            self.header.n_ff,
        );
        let stride = h.stride();
        let place = &self.place[layer * n_ff..(layer + 1) * n_ff];
        // (place, index asked), in file order.
        let mut by_place: Vec<(u32, u32)> = neurons
            .iter()
            .enumerate()
            .map(|(i, &n)| (place[n as usize], i as u32))
            .collect();
        by_place.sort_unstable();
        let base = out.len();
        out.resize(base + neurons.len() * rb, 0);
        let mut buf = Vec::new();
        let mut read = 0u64;
        let mut i = 0;
        while i < by_place.len() {
            let first = by_place[i].0 as usize;
            let mut end = i + 1;
            while end < by_place.len() && by_place[end].0 as usize == first + (end - i) {
                end += 1;
            }
            // The run's bytes: from its first record to the end of its last one's CRC.
            let at = h.record_offset(layer, first);
            let len = h.record_offset(layer, first + (end - i - 1)) + stride as u64 - at;
            buf.resize(len as usize, 0);
            self.file
                .read_exact_at(&mut buf, at)
                .map_err(|source| Error::Io {
                    path: self.path.clone(),
                    source,
                })?;
            read += len;
            for &(place, asked) in &by_place[i..end] {
                let neuron = neurons[asked as usize] as usize;
                let chunk =
                    &buf[(h.record_offset(layer, place as usize) - at) as usize..][..stride];
                let (record, crc) = chunk.split_at(rb);
                if record_crc(layer, neuron, record)
                    != u32::from_le_bytes(crc.try_into().expect("4 bytes"))
                {
                    return Err(Error::DamagedRecord {
                        path: self.path.clone(),
                        layer,
                        neuron,
                    });
                }
                out[base + asked as usize * rb..][..rb].copy_from_slice(record);
            }
            i = end;
        }
        Ok(read)
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
        let base = out.len();
        let read = self.read_records(layer, neurons, out);
        if read.is_err() {
            // Nothing of a failed read is left in `out`.
            out.truncate(base);
        }
        read
    }
}
