//! Coded weights decoded on the device (`decode.wgsl`): a streamed weight whose store
//! lends its coded chunks ([`crate::weights::WeightBytes::coded`]) goes up as those
//! chunks, and one workgroup per chunk decodes it into the stream slot, so the bytes
//! uploaded per token are the coded ones.
//!
//! The stored bytes' checksums are the store's to check before it lends them (the
//! weight-codec store checks them per request, and decodes a layer once on the CPU
//! the first time, against the raw checksums). The kernel checks every read and
//! writes what it finds wrong per chunk into a status buffer: [`WgpuBackend::decode_coded`]
//! reads it back and refuses a chunk by name; a streamed layer's pass does not (that
//! would be a read-back per layer), which is why the store's checks come first.

use super::*;
use crate::weights::{ChunkCoding, CodedChunk};

pub(crate) const DECODE: Shader = Shader::checked(
    "ballast.decode",
    concat!(include_str!("params.wgsl"), include_str!("decode.wgsl")),
);

/// Words of a chunk's descriptor (`DESC_WORDS` in decode.wgsl).
const DESC_WORDS: usize = 40;
/// Planes a descriptor holds (`MAX_PLANES` in decode.wgsl).
const MAX_PLANES: usize = 8;

/// One weight's coded chunks as decode.wgsl reads them: the stored bytes, each chunk at
/// a 4-byte aligned offset, and a descriptor per chunk.
pub(super) struct CodedLayout {
    pub(super) stored: Vec<u8>,
    pub(super) descriptors: Vec<u32>,
    pub(super) n_chunks: u32,
    /// Decoded bytes of all the chunks.
    pub(super) raw_len: u64,
}

impl CodedLayout {
    /// The layout of `chunks`, or `None` if the kernel cannot decode one of them (more
    /// planes than a descriptor holds, a length past 32 bits).
    pub(super) fn new(chunks: &[CodedChunk<'_>]) -> Option<CodedLayout> {
        let mut stored = Vec::new();
        let mut descriptors = Vec::with_capacity(chunks.len() * DESC_WORDS);
        let mut raw_len = 0u64;
        for c in chunks {
            if c.planes.len() > MAX_PLANES {
                return None;
            }
            let stored_at = u32::try_from(stored.len()).ok()?;
            let coding = match c.coding {
                ChunkCoding::Raw => 0,
                ChunkCoding::RansLanes => 1,
            };
            descriptors.extend([
                stored_at,
                u32::try_from(c.stored.len()).ok()?,
                u32::try_from(raw_len).ok()?,
                u32::try_from(c.raw_len).ok()?,
                coding,
                u32::try_from(c.block_bytes).ok()?,
                c.planes.len() as u32,
                0,
            ]);
            for k in 0..MAX_PLANES {
                match c.planes.get(k) {
                    Some(pl) => descriptors.extend([pl.offset, pl.per_block, pl.stride, pl.byte]),
                    None => descriptors.extend([0; 4]),
                }
            }
            stored.extend_from_slice(c.stored);
            stored.resize(stored.len().div_ceil(4) * 4, 0);
            raw_len += c.raw_len as u64;
        }
        u32::try_from(raw_len.div_ceil(4) * 4).ok()?;
        Some(CodedLayout {
            stored,
            descriptors,
            n_chunks: chunks.len() as u32,
            raw_len,
        })
    }

    /// Bytes this layout moves from the host: the stored chunks and the descriptors.
    pub(super) fn upload_bytes(&self) -> u64 {
        (self.stored.len() + self.descriptors.len() * 4) as u64
    }
}

/// The device buffers one coded weight is decoded through.
pub(super) struct DecodeBuffers<'b> {
    pub(super) stored: &'b wgpu::Buffer,
    pub(super) descriptors: &'b wgpu::Buffer,
    pub(super) status: &'b wgpu::Buffer,
    pub(super) out: &'b wgpu::Buffer,
}

/// Records the decode of `layout` (its stored bytes and descriptors already written to
/// `buffers`) into `buffers.out`: clears the output and the status first, since the
/// kernel ORs bytes into words.
pub(super) fn record_decode(
    rec: &mut Recorder<'_>,
    layout: &CodedLayout,
    buffers: &DecodeBuffers<'_>,
) {
    let out_bytes = layout.raw_len.div_ceil(4).max(1) * 4;
    rec.clear(buffers.out, out_bytes);
    rec.clear(buffers.status, u64::from(layout.n_chunks).max(1) * 4);
    rec.dispatch(
        &DECODE,
        "decode_chunks",
        &[],
        &[
            buffers.stored,
            buffers.descriptors,
            buffers.out,
            buffers.status,
        ],
        Params::new([layout.n_chunks, 0, 0, 0], [0; 4], [0.0; 4]),
        [layout.n_chunks, 1, 1],
        "decode",
        layout.stored.len() as u64,
        layout.raw_len,
        0,
    );
}

/// What decode.wgsl's status code `code` means.
fn status_meaning(code: u32) -> &'static str {
    match code {
        1 => "its length disagrees with the stream's",
        2 => "the lane count is out of range",
        3 => "the frequency table is malformed",
        4 => "the lane lengths do not fit the chunk",
        5 => "a lane runs past its bytes",
        6 => "a lane does not end where its encoder began",
        7 => "a raw chunk's stored length is not its raw length",
        _ => "unknown status",
    }
}

impl WgpuBackend {
    /// Decodes one weight's coded `chunks` on the device and reads the bytes back, as a
    /// streamed layer's upload decodes them (for tests and measurements). A chunk the
    /// kernel refuses is [`Error::DeviceDecode`] naming `tensor` and the chunk.
    pub fn decode_coded(&self, tensor: &str, chunks: &[CodedChunk<'_>]) -> Result<Vec<u8>> {
        let layout = CodedLayout::new(chunks).ok_or_else(|| Error::GpuLimit {
            what: format!("decoding {tensor} on the device"),
            needed: chunks.iter().map(|c| c.raw_len as u64).sum(),
            limit: u64::from(u32::MAX),
        })?;
        let mut rec = self.recorder();
        let stored = rec.upload("coded chunks", &layout.stored)?;
        let descriptors = rec.upload(
            "chunk descriptors",
            bytemuck::cast_slice(&layout.descriptors),
        )?;
        let status_bytes = u64::from(layout.n_chunks).max(1) * 4;
        let status = rec.buffer("decode status", status_bytes)?;
        let out_bytes = layout.raw_len.div_ceil(4).max(1) * 4;
        let out = rec.buffer("decoded weight", out_bytes)?;
        rec.add_upload(layout.upload_bytes());
        record_decode(
            &mut rec,
            &layout,
            &DecodeBuffers {
                stored: &stored,
                descriptors: &descriptors,
                status: &status,
                out: &out,
            },
        );
        let (bytes, _) = rec.finish(&[(&out, 0, out_bytes), (&status, 0, status_bytes)])?;
        let statuses: Vec<u32> = bytemuck::pod_collect_to_vec(&bytes[out_bytes as usize..]);
        if let Some((chunk, &code)) = statuses
            .iter()
            .take(layout.n_chunks as usize)
            .enumerate()
            .find(|(_, &s)| s != 0)
        {
            return Err(Error::DeviceDecode {
                tensor: tensor.to_string(),
                chunk,
                what: status_meaning(code).to_string(),
            });
        }
        Ok(bytes[..layout.raw_len as usize].to_vec())
    }
}
