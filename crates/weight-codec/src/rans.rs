//! An order-0 byte coder: static rANS (after Fabian Giesen's `rans_byte`) with a
//! frequency table per chunk and four interleaved states, so that decoding has four
//! independent dependency chains (and a GPU workgroup could take one chunk).
//!
//! Stream layout: the number of symbols (u32 little-endian: a one-symbol alphabet
//! codes no bits, so the length must be said), the 256 symbol frequencies (LEB128, summing to [`PROB_SCALE`]), then
//! the four final encoder states (u32 little-endian, state 0 first), then the
//! renormalization bytes in the order the decoder reads them. The decoder checks every
//! read against the end of the stream and every table against its invariants, so a
//! hostile stream gives an error, never a panic or an endless loop.
//!
//! [`encode_lanes`] / [`decode_lanes`] are the GPU-friendly variant (coder id 3,
//! `rans-lanes`): the chunk is cut into up to [`MAX_LANES`] contiguous lanes, each
//! coded by one state with a byte stream of its own, so one GPU workgroup decodes a
//! chunk with one invocation per lane; and into up to [`MAX_TABLES`] consecutive
//! segments (the planes of a transform), each with a frequency table of its own, since
//! the planes' byte distributions differ (an f16 scale's high byte against packed
//! quants). Its layout: the number of symbols (u32), the number of lanes (u32, 1 ..=
//! [`MAX_LANES`]), the number of segments (u32, 1 ..= [`MAX_TABLES`]), per segment its
//! number of symbols (u32; they sum to the chunk's) and its frequency table as above,
//! then per lane the length of its byte stream (u32), then per lane its final encoder
//! state (u32), then the lanes' byte streams, lane 0 first. Lane `j` codes symbols
//! `j * s .. min((j + 1) * s, n)` where `s = ceil(n / lanes)`, each with the table of its
//! segment. The runtime's WGSL decoder (`backend/wgpu/decode.wgsl`) reads exactly this
//! layout.

/// Bits of probability precision.
pub const PROB_BITS: u32 = 12;
/// Sum of the frequencies of one table.
pub const PROB_SCALE: u32 = 1 << PROB_BITS;
/// Lower bound of a normalized state.
pub const RANS_L: u32 = 1 << 23;
const LANES: usize = 4;
/// Most lanes of a [`encode_lanes`] stream: the invocations of one GPU workgroup.
pub const MAX_LANES: usize = 64;
/// Symbols per lane [`encode_lanes`] aims at: each lane costs 8 bytes of header, so
/// short chunks get fewer lanes.
const SYMBOLS_PER_LANE: usize = 4096;
/// Most segments (frequency tables) of a [`encode_lanes`] stream: what one GPU
/// workgroup holds (the planes of every tensor type, plus the bytes after the last
/// whole block).
pub const MAX_TABLES: usize = 8;

/// Frequencies of the bytes of `data`, scaled to sum to [`PROB_SCALE`] with every
/// present byte at least 1.
fn normalized_freqs(data: &[u8]) -> [u32; 256] {
    let mut counts = [0u64; 256];
    for &b in data {
        counts[b as usize] += 1;
    }
    let total = data.len() as u64;
    let mut freqs = [0u32; 256];
    if total == 0 {
        freqs[0] = PROB_SCALE;
        return freqs;
    }
    for (f, &c) in freqs.iter_mut().zip(&counts) {
        if c > 0 {
            *f = ((c * PROB_SCALE as u64 / total) as u32).max(1);
        }
    }
    // Rounding leaves the sum off by at most a few hundred: move the difference onto
    // the most frequent symbols, where it costs the least.
    let mut sum: u32 = freqs.iter().sum();
    while sum != PROB_SCALE {
        let (best, _) = freqs
            .iter()
            .enumerate()
            .filter(|(_, &f)| sum < PROB_SCALE || f > 1)
            .max_by_key(|(_, &f)| f)
            .expect("some symbol has a frequency above 1 while the sum exceeds the scale");
        if sum < PROB_SCALE {
            freqs[best] += 1;
            sum += 1;
        } else {
            freqs[best] -= 1;
            sum -= 1;
        }
    }
    freqs
}

fn put_varint(out: &mut Vec<u8>, mut v: u32) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// The cumulative frequencies of `freqs` (`cum[s]` is the sum of those below `s`).
fn cumulative(freqs: &[u32; 256]) -> [u32; 257] {
    let mut cum = [0u32; 257];
    for s in 0..256 {
        cum[s + 1] = cum[s] + freqs[s];
    }
    cum
}

/// One encoder step: `x` takes symbol `b` (bytes it sheds pushed onto `rev`).
fn encode_symbol(x: &mut u32, b: u8, freqs: &[u32; 256], cum: &[u32; 257], rev: &mut Vec<u8>) {
    let (f, c) = (freqs[b as usize], cum[b as usize]);
    let x_max = ((RANS_L >> PROB_BITS) << 8) * f;
    while *x >= x_max {
        rev.push(*x as u8);
        *x >>= 8;
    }
    *x = ((*x / f) << PROB_BITS) + (*x % f) + c;
}

fn symbol_count(data: &[u8]) -> [u8; 4] {
    u32::try_from(data.len())
        .expect("chunks are at most 4 GiB")
        .to_le_bytes()
}

/// Appends the rANS stream of `data` to `out`.
pub fn encode(data: &[u8], out: &mut Vec<u8>) {
    let freqs = normalized_freqs(data);
    let cum = cumulative(&freqs);
    out.extend(symbol_count(data));
    for &f in &freqs {
        put_varint(out, f);
    }
    // The encoder runs backwards; its bytes are collected reversed, then flipped.
    let mut rev: Vec<u8> = Vec::with_capacity(data.len() / 2 + 16);
    let mut states = [RANS_L; LANES];
    for (i, &b) in data.iter().enumerate().rev() {
        encode_symbol(&mut states[i % LANES], b, &freqs, &cum, &mut rev);
    }
    // The decoder reads state 0 first, each little-endian.
    for x in states.iter().rev() {
        rev.extend(x.to_be_bytes());
    }
    rev.reverse();
    out.extend_from_slice(&rev);
}

/// Decodes the rANS stream `stream` into `out`, which must have exactly the length of
/// the data that was encoded.
pub fn decode(stream: &[u8], out: &mut [u8]) -> Result<(), String> {
    let n = stream.get(..4).ok_or("stream ends inside its length")?;
    let n = u32::from_le_bytes([n[0], n[1], n[2], n[3]]) as usize;
    if n != out.len() {
        return Err(format!("stream holds {n} symbols, {} expected", out.len()));
    }
    let mut at = 4usize;
    let table = Table::read(stream, &mut at)?;
    let mut states = [0u32; LANES];
    for x in &mut states {
        *x = read_u32(stream, &mut at, "the initial states")?;
        if *x < RANS_L {
            return Err(format!(
                "initial state {x:#x} is below the normalized range"
            ));
        }
    }
    let bytes = &stream[at..];
    let mut p = 0usize;
    for (i, o) in out.iter_mut().enumerate() {
        let x = &mut states[i % LANES];
        *o = table.decode_symbol(x);
        while *x < RANS_L {
            let b = *bytes
                .get(p)
                .ok_or_else(|| format!("stream ends at output byte {i}"))?;
            p += 1;
            *x = (*x << 8) | b as u32;
        }
    }
    if p != bytes.len() {
        return Err(format!(
            "{} bytes left after the last symbol",
            bytes.len() - p
        ));
    }
    if states.iter().any(|&x| x != RANS_L) {
        return Err("final states are not the encoder's initial states".into());
    }
    Ok(())
}

/// The little-endian u32 at `*at` (advanced past it); `what` names it in the error.
fn read_u32(stream: &[u8], at: &mut usize, what: &str) -> Result<u32, String> {
    let b = stream
        .get(*at..*at + 4)
        .ok_or_else(|| format!("stream ends inside {what}"))?;
    *at += 4;
    Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// A decoding table: frequencies, their cumulative sums and the symbol of every slot.
struct Table {
    freqs: [u32; 256],
    cum: [u32; 256],
    slot_sym: Vec<u8>,
}

impl Table {
    /// Reads the 256 LEB128 frequencies at `*at` (advanced past them) and checks they
    /// sum to [`PROB_SCALE`].
    fn read(stream: &[u8], at: &mut usize) -> Result<Table, String> {
        let mut freqs = [0u32; 256];
        for (s, f) in freqs.iter_mut().enumerate() {
            let mut v = 0u32;
            let mut shift = 0;
            loop {
                let b = *stream
                    .get(*at)
                    .ok_or_else(|| format!("frequency table ends at symbol {s}"))?;
                *at += 1;
                if shift > 14 {
                    return Err(format!("frequency of symbol {s} is too long"));
                }
                v |= ((b & 0x7f) as u32) << shift;
                shift += 7;
                if b & 0x80 == 0 {
                    break;
                }
            }
            *f = v;
        }
        let sum: u64 = freqs.iter().map(|&f| f as u64).sum();
        if sum != PROB_SCALE as u64 {
            return Err(format!("frequencies sum to {sum}, not {PROB_SCALE}"));
        }
        let mut cum = [0u32; 256];
        let mut slot_sym = vec![0u8; PROB_SCALE as usize];
        let mut c = 0u32;
        for s in 0..256 {
            cum[s] = c;
            slot_sym[c as usize..(c + freqs[s]) as usize].fill(s as u8);
            c += freqs[s];
        }
        Ok(Table {
            freqs,
            cum,
            slot_sym,
        })
    }

    /// One decoder step: the symbol `x` holds, and `x` without it (not yet
    /// renormalized).
    fn decode_symbol(&self, x: &mut u32) -> u8 {
        let slot = *x & (PROB_SCALE - 1);
        let s = self.slot_sym[slot as usize];
        // f <= 4096 and x >> 12 < 2^20, so this fits in u32 (the table summed to the scale).
        *x = self.freqs[s as usize] * (*x >> PROB_BITS) + slot - self.cum[s as usize];
        s
    }
}

/// Lanes [`encode_lanes`] uses for `n` symbols.
pub fn lanes_for(n: usize) -> usize {
    n.div_ceil(SYMBOLS_PER_LANE).clamp(1, MAX_LANES)
}

/// Walks the segments of a lane-coded chunk: which one a symbol index falls in.
struct SegmentCursor<'a> {
    lens: &'a [usize],
    segment: usize,
    /// Symbols left in `segment` from the current one.
    left: usize,
}

impl SegmentCursor<'_> {
    /// A cursor on symbol `i` of a chunk cut into segments of `lens` (they sum to at
    /// least `i`; at the end, the cursor stands past the last segment).
    fn at(lens: &[usize], i: usize) -> SegmentCursor<'_> {
        let mut start = 0;
        for (segment, &len) in lens.iter().enumerate() {
            if i < start + len {
                return SegmentCursor {
                    lens,
                    segment,
                    left: start + len - i,
                };
            }
            start += len;
        }
        SegmentCursor {
            lens,
            segment: lens.len(),
            left: 0,
        }
    }

    /// The segment of the current symbol; moves to the next symbol.
    fn next_segment(&mut self) -> usize {
        while self.left == 0 && self.segment + 1 < self.lens.len() {
            self.segment += 1;
            self.left = self.lens[self.segment];
        }
        self.left = self.left.saturating_sub(1);
        self.segment
    }
}

/// Appends the lane-parallel rANS stream of `data` to `out` (layout in the
/// [module docs](self)), with a table per segment of `segments` (their lengths, summing
/// to `data.len()`; empty ones are dropped, and past [`MAX_TABLES`] the last ones
/// share a table).
pub fn encode_lanes(data: &[u8], segments: &[usize], out: &mut Vec<u8>) {
    let mut lens: Vec<usize> = segments.iter().copied().filter(|&l| l > 0).collect();
    if lens.len() > MAX_TABLES {
        let rest: usize = lens[MAX_TABLES - 1..].iter().sum();
        lens.truncate(MAX_TABLES - 1);
        lens.push(rest);
    }
    if lens.is_empty() {
        lens.push(0);
    }
    assert_eq!(
        lens.iter().sum::<usize>(),
        data.len(),
        "segments cover the chunk"
    );
    let mut tables = Vec::with_capacity(lens.len());
    let mut start = 0;
    for &len in &lens {
        let freqs = normalized_freqs(&data[start..start + len]);
        tables.push((freqs, cumulative(&freqs)));
        start += len;
    }
    let lanes = lanes_for(data.len());
    let per_lane = data.len().div_ceil(lanes);
    out.extend(symbol_count(data));
    out.extend((lanes as u32).to_le_bytes());
    out.extend((lens.len() as u32).to_le_bytes());
    for (&len, (freqs, _)) in lens.iter().zip(&tables) {
        out.extend((len as u32).to_le_bytes());
        for &f in freqs {
            put_varint(out, f);
        }
    }
    let mut streams = Vec::with_capacity(lanes);
    let mut states = Vec::with_capacity(lanes);
    for lane in 0..lanes {
        let start = (lane * per_lane).min(data.len());
        let end = ((lane + 1) * per_lane).min(data.len());
        // The encoder runs backwards: the segment of each symbol, found forwards.
        let mut cursor = SegmentCursor::at(&lens, start);
        let segment_of: Vec<u8> = (start..end).map(|_| cursor.next_segment() as u8).collect();
        let mut rev = Vec::with_capacity((end - start) / 2 + 4);
        let mut x = RANS_L;
        for (&b, &t) in data[start..end].iter().zip(&segment_of).rev() {
            let (freqs, cum) = &tables[t as usize];
            encode_symbol(&mut x, b, freqs, cum, &mut rev);
        }
        rev.reverse();
        streams.push(rev);
        states.push(x);
    }
    for s in &streams {
        out.extend((s.len() as u32).to_le_bytes());
    }
    for x in &states {
        out.extend(x.to_le_bytes());
    }
    for s in &streams {
        out.extend_from_slice(s);
    }
}

/// Decodes the lane-parallel rANS stream `stream` into `out`, which must have exactly
/// the length of the data that was encoded. Checks what the WGSL decoder checks: the
/// lane and segment counts, the segments covering the chunk, every table, every lane's
/// stream inside the chunk, every read inside its lane, each lane ending on the
/// encoder's initial state with its bytes all read.
pub fn decode_lanes(stream: &[u8], out: &mut [u8]) -> Result<(), String> {
    let mut at = 0usize;
    let n = read_u32(stream, &mut at, "its length")? as usize;
    if n != out.len() {
        return Err(format!("stream holds {n} symbols, {} expected", out.len()));
    }
    let lanes = read_u32(stream, &mut at, "its lane count")? as usize;
    if lanes == 0 || lanes > MAX_LANES {
        return Err(format!("{lanes} lanes, expected 1 to {MAX_LANES}"));
    }
    let n_tables = read_u32(stream, &mut at, "its segment count")? as usize;
    if n_tables == 0 || n_tables > MAX_TABLES {
        return Err(format!("{n_tables} segments, expected 1 to {MAX_TABLES}"));
    }
    let mut lens = Vec::with_capacity(n_tables);
    let mut tables = Vec::with_capacity(n_tables);
    for _ in 0..n_tables {
        lens.push(read_u32(stream, &mut at, "the segment lengths")? as usize);
        tables.push(Table::read(stream, &mut at)?);
    }
    if lens.iter().sum::<usize>() != n {
        return Err(format!("segments do not sum to the {n} symbols"));
    }
    let mut lens_of_lanes = Vec::with_capacity(lanes);
    for _ in 0..lanes {
        lens_of_lanes.push(read_u32(stream, &mut at, "the lane lengths")? as usize);
    }
    let mut states = Vec::with_capacity(lanes);
    for _ in 0..lanes {
        states.push(read_u32(stream, &mut at, "the lane states")?);
    }
    let per_lane = n.div_ceil(lanes);
    for (lane, (&len, mut x)) in lens_of_lanes.iter().zip(states).enumerate() {
        let bytes = stream
            .get(at..)
            .and_then(|rest| rest.get(..len))
            .ok_or_else(|| format!("lane {lane}'s {len} bytes run past the stream"))?;
        at += len;
        if x < RANS_L {
            return Err(format!(
                "lane {lane}'s state {x:#x} is below the normalized range"
            ));
        }
        let start = (lane * per_lane).min(n);
        let end = ((lane + 1) * per_lane).min(n);
        let mut cursor = SegmentCursor::at(&lens, start);
        let mut p = 0usize;
        for (i, o) in out[start..end].iter_mut().enumerate() {
            *o = tables[cursor.next_segment()].decode_symbol(&mut x);
            while x < RANS_L {
                let b = *bytes
                    .get(p)
                    .ok_or_else(|| format!("lane {lane} ends at its symbol {i}"))?;
                p += 1;
                x = (x << 8) | b as u32;
            }
        }
        if p != len || x != RANS_L {
            return Err(format!("lane {lane} does not end where its encoder began"));
        }
    }
    if at != stream.len() {
        return Err(format!(
            "{} bytes left after the last lane",
            stream.len() - at
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skewed_data_shrinks_and_round_trips() {
        let data: Vec<u8> = (0..100_000u32)
            .map(|i| if i % 7 == 0 { (i % 13) as u8 } else { 3 })
            .collect();
        let mut s = Vec::new();
        encode(&data, &mut s);
        assert!(s.len() < data.len() / 3, "{} bytes", s.len());
        let mut back = vec![0; data.len()];
        decode(&s, &mut back).unwrap();
        assert_eq!(back, data);
    }

    #[test]
    fn lanes_round_trip_at_any_length_and_refuse_changes() {
        for n in [0usize, 1, 3, 4095, 4096, 4097, 70_000, 300_000] {
            let data: Vec<u8> = (0..n as u32).map(|i| (i * 7 % 13) as u8).collect();
            // Segments of every kind: empty, one symbol, more than the tables.
            let mut segments = vec![0, n.min(1), n / 3, 0, 0, 0];
            let ones = 9.min(n - segments.iter().sum::<usize>());
            segments.extend(std::iter::repeat_n(1, ones));
            let rest = n - segments.iter().sum::<usize>();
            segments.push(rest);
            let mut s = Vec::new();
            encode_lanes(&data, &segments, &mut s);
            let mut back = vec![0; n];
            decode_lanes(&s, &mut back).unwrap();
            assert_eq!(back, data, "{n}");
            if n > 100 {
                let mut shorter = s.clone();
                shorter.pop();
                assert!(decode_lanes(&shorter, &mut back).is_err());
                let mut longer = s.clone();
                longer.push(0);
                assert!(decode_lanes(&longer, &mut back).is_err());
            }
        }
    }

    #[test]
    fn truncated_or_padded_stream_is_an_error() {
        let data: Vec<u8> = (0..5000u32).map(|i| (i * i % 251) as u8).collect();
        let mut s = Vec::new();
        encode(&data, &mut s);
        let mut back = vec![0; data.len()];
        assert!(decode(&s[..s.len() - 1], &mut back).is_err());
        let mut longer = s.clone();
        longer.push(0);
        assert!(decode(&longer, &mut back).is_err());
    }
}
