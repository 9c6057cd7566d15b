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

/// Bits of probability precision.
pub const PROB_BITS: u32 = 12;
/// Sum of the frequencies of one table.
pub const PROB_SCALE: u32 = 1 << PROB_BITS;
/// Lower bound of a normalized state.
const RANS_L: u32 = 1 << 23;
const LANES: usize = 4;

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

/// Appends the rANS stream of `data` to `out`.
pub fn encode(data: &[u8], out: &mut Vec<u8>) {
    let freqs = normalized_freqs(data);
    let mut cum = [0u32; 257];
    for s in 0..256 {
        cum[s + 1] = cum[s] + freqs[s];
    }
    out.extend(
        u32::try_from(data.len())
            .expect("chunks are at most 4 GiB")
            .to_le_bytes(),
    );
    for &f in &freqs {
        put_varint(out, f);
    }
    // The encoder runs backwards; its bytes are collected reversed, then flipped.
    let mut rev: Vec<u8> = Vec::with_capacity(data.len() / 2 + 16);
    let mut states = [RANS_L; LANES];
    for (i, &b) in data.iter().enumerate().rev() {
        let x = &mut states[i % LANES];
        let (f, c) = (freqs[b as usize], cum[b as usize]);
        let x_max = ((RANS_L >> PROB_BITS) << 8) * f;
        while *x >= x_max {
            rev.push(*x as u8);
            *x >>= 8;
        }
        *x = ((*x / f) << PROB_BITS) + (*x % f) + c;
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
    let mut freqs = [0u32; 256];
    for (s, f) in freqs.iter_mut().enumerate() {
        let mut v = 0u32;
        let mut shift = 0;
        loop {
            let b = *stream
                .get(at)
                .ok_or_else(|| format!("frequency table ends at symbol {s}"))?;
            at += 1;
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
    let mut states = [0u32; LANES];
    for x in &mut states {
        let b = stream
            .get(at..at + 4)
            .ok_or("stream ends inside the initial states")?;
        *x = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        at += 4;
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
        let slot = *x & (PROB_SCALE - 1);
        let s = slot_sym[slot as usize];
        *o = s;
        // f <= 4096 and x >> 12 < 2^20, so this fits in u32 (the table summed to the scale).
        *x = freqs[s as usize] * (*x >> PROB_BITS) + slot - cum[s as usize];
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
