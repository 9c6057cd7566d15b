//! GPT-2 style byte <-> printable character mapping used by byte-level BPE vocabularies.

/// Table mapping every byte to the printable `char` GPT-2 uses for it.
pub(crate) fn bytes_to_chars() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut extra = 0u32;
    for b in 0u32..256 {
        let printable =
            (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
        let c = if printable {
            b
        } else {
            let c = 256 + extra;
            extra += 1;
            c
        };
        table[b as usize] = char::from_u32(c).unwrap_or('\u{FFFD}');
    }
    table
}

/// Decodes a byte-level token text back to raw bytes. Characters outside the byte
/// table (which a well-formed byte-level vocabulary never contains) are kept as UTF-8.
pub(crate) fn decode_token_text(
    text: &str,
    chars_to_bytes: &std::collections::HashMap<char, u8>,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    for c in text.chars() {
        match chars_to_bytes.get(&c) {
            Some(&b) => out.push(b),
            None => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
    out
}
