//! Codecs: a [`Transform`] that rearranges a chunk's bytes, then a [`Coder`] that
//! entropy-codes them. Each chunk is a run of whole blocks of the tensor (the last
//! may end mid-block), coded on its own, so chunks decode independently and in
//! parallel and a reader can start on any of them.

use ballast_core::ggml_type::GgmlType;

use crate::error::Corruption;
use crate::{rans, transform};

/// How a chunk's bytes are rearranged before coding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Transform {
    /// Bytes as in the file.
    None,
    /// Planes of the tensor type's fields ([`transform::split`]).
    Planes,
}

/// How a chunk's (transformed) bytes are coded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Coder {
    /// Stored as they are.
    Raw,
    /// zstd (one frame per chunk).
    Zstd,
    /// Order-0 rANS with a table per chunk ([`rans`]).
    Rans,
    /// Order-0 rANS in independent lanes, each with its own byte stream
    /// ([`rans::encode_lanes`]): what a GPU decodes, one workgroup per chunk.
    RansLanes,
}

impl Coder {
    /// Whether a device decodes this coder itself (so a store may lend its stored
    /// bytes: [`ballast_core::weights::CodedChunk`]).
    pub fn device_decodable(self) -> bool {
        matches!(self, Coder::Raw | Coder::RansLanes)
    }
}

/// A transform and a coder: what a tensor is packed with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Codec {
    /// The rearrangement.
    pub transform: Transform,
    /// The entropy coder.
    pub coder: Coder,
}

impl Codec {
    /// Bytes stored as they are.
    pub const RAW: Codec = Codec {
        transform: Transform::None,
        coder: Coder::Raw,
    };
    /// zstd over the file's bytes (what the issue measured as a baseline).
    pub const ZSTD: Codec = Codec {
        transform: Transform::None,
        coder: Coder::Zstd,
    };
    /// Planes, then zstd.
    pub const PLANES_ZSTD: Codec = Codec {
        transform: Transform::Planes,
        coder: Coder::Zstd,
    };
    /// Planes, then order-0 rANS.
    pub const PLANES_RANS: Codec = Codec {
        transform: Transform::Planes,
        coder: Coder::Rans,
    };
    /// Lane-parallel rANS over the file's bytes, one table per chunk.
    pub const RANS_LANES: Codec = Codec {
        transform: Transform::None,
        coder: Coder::RansLanes,
    };
    /// Planes, then lane-parallel rANS with a table per plane: the codec a GPU decodes
    /// (`ballast pack --codec gpu` tries it and [`Codec::RANS_LANES`]).
    pub const PLANES_RANS_LANES: Codec = Codec {
        transform: Transform::Planes,
        coder: Coder::RansLanes,
    };
    /// The codecs a device decodes (`ballast pack --codec gpu`).
    pub const GPU_CANDIDATES: [Codec; 2] = [Codec::PLANES_RANS_LANES, Codec::RANS_LANES];
    /// The codecs [`crate::PackOptions::default`] tries on every tensor.
    pub const CANDIDATES: [Codec; 3] = [Codec::ZSTD, Codec::PLANES_ZSTD, Codec::PLANES_RANS];

    /// One byte for the file: transform in the high nibble, coder in the low one.
    pub fn id(self) -> u8 {
        let t = match self.transform {
            Transform::None => 0,
            Transform::Planes => 1,
        };
        let c = match self.coder {
            Coder::Raw => 0,
            Coder::Zstd => 1,
            Coder::Rans => 2,
            Coder::RansLanes => 3,
        };
        (t << 4) | c
    }

    /// The codec of [`Codec::id`], or `None` for an unknown byte.
    pub fn from_id(id: u8) -> Option<Codec> {
        let transform = match id >> 4 {
            0 => Transform::None,
            1 => Transform::Planes,
            _ => return None,
        };
        let coder = match id & 15 {
            0 => Coder::Raw,
            1 => Coder::Zstd,
            2 => Coder::Rans,
            3 => Coder::RansLanes,
            _ => return None,
        };
        Some(Codec { transform, coder })
    }

    /// A short name: `raw`, `zstd`, `planes+zstd`, `planes+rans`, `planes+rans-lanes`.
    pub fn name(self) -> String {
        let c = match self.coder {
            Coder::Raw => "raw",
            Coder::Zstd => "zstd",
            Coder::Rans => "rans",
            Coder::RansLanes => "rans-lanes",
        };
        match self.transform {
            Transform::None => c.to_string(),
            Transform::Planes => format!("planes+{c}"),
        }
    }
}

impl std::fmt::Display for Codec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

/// Encodes one chunk of a tensor of type `ty` with `codec` at zstd level `level`
/// (ignored by the other coders), appending the stored bytes to `out`.
pub fn encode_chunk(ty: GgmlType, codec: Codec, level: i32, raw: &[u8], out: &mut Vec<u8>) {
    let planes;
    let src = match codec.transform {
        Transform::None => raw,
        Transform::Planes => {
            let mut p = Vec::with_capacity(raw.len());
            transform::split(ty, raw, &mut p);
            planes = p;
            &planes[..]
        }
    };
    match codec.coder {
        Coder::Raw => out.extend_from_slice(src),
        Coder::Zstd => {
            let z = zstd::bulk::compress(src, level)
                .expect("zstd compresses into a growable buffer without error");
            out.extend_from_slice(&z);
        }
        Coder::Rans => rans::encode(src, out),
        // A table per plane: their byte distributions differ.
        Coder::RansLanes => match codec.transform {
            Transform::None => rans::encode_lanes(src, &[src.len()], out),
            Transform::Planes => {
                rans::encode_lanes(src, &transform::plane_lengths(ty, src.len()), out)
            }
        },
    }
}

/// Decodes one chunk stored with `codec` into `out` (its raw length).
pub fn decode_chunk(
    ty: GgmlType,
    codec: Codec,
    stored: &[u8],
    out: &mut [u8],
) -> Result<(), Corruption> {
    let mut planes = match codec.transform {
        Transform::None => None,
        Transform::Planes => Some(vec![0u8; out.len()]),
    };
    {
        let dst: &mut [u8] = planes.as_deref_mut().unwrap_or(&mut *out);
        match codec.coder {
            Coder::Raw => {
                if stored.len() != dst.len() {
                    return Err(Corruption::Length {
                        expected: dst.len(),
                        got: stored.len(),
                    });
                }
                dst.copy_from_slice(stored);
            }
            Coder::Zstd => {
                let n = zstd::bulk::decompress_to_buffer(stored, dst).map_err(|e| {
                    Corruption::Stream {
                        coder: "zstd",
                        detail: e.to_string(),
                    }
                })?;
                if n != dst.len() {
                    return Err(Corruption::Length {
                        expected: dst.len(),
                        got: n,
                    });
                }
            }
            Coder::Rans => rans::decode(stored, dst).map_err(|detail| Corruption::Stream {
                coder: "rans",
                detail,
            })?,
            Coder::RansLanes => {
                rans::decode_lanes(stored, dst).map_err(|detail| Corruption::Stream {
                    coder: "rans-lanes",
                    detail,
                })?
            }
        }
    }
    if let Some(p) = planes {
        transform::join(ty, &p, out);
    }
    Ok(())
}

/// Raw bytes per chunk for a tensor of `ty`: `target` rounded down to whole blocks
/// (at least one block).
pub fn chunk_len(ty: GgmlType, target: usize) -> usize {
    let bb = ty.block_bytes();
    (target / bb).max(1) * bb
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codec_ids_round_trip_and_unknown_ids_are_refused() {
        for t in [Transform::None, Transform::Planes] {
            for c in [Coder::Raw, Coder::Zstd, Coder::Rans, Coder::RansLanes] {
                let codec = Codec {
                    transform: t,
                    coder: c,
                };
                assert_eq!(Codec::from_id(codec.id()), Some(codec));
            }
        }
        assert_eq!(Codec::from_id(0x04), None);
        assert_eq!(Codec::from_id(0x21), None);
    }
}
