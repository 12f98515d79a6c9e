//! GPT-2's byte-to-unicode mapping.
//!
//! GPT-2's BPE vocabulary is written over printable stand-ins for the 256 byte values, so
//! every pre-token's UTF-8 bytes are mapped to those characters before BPE, and mapped back
//! when decoding.

/// The printable stand-in of every byte value, as in OpenAI's `bytes_to_unicode()`.
pub const BYTE_TO_CHAR: [char; 256] = {
    let mut table = ['\0'; 256];
    let mut next_extra = 256u32;
    let mut b = 0usize;
    while b < 256 {
        let printable = (b >= b'!' as usize && b <= b'~' as usize)
            || (b >= 0xA1 && b <= 0xAC)
            || (b >= 0xAE && b <= 0xFF);
        let code = if printable {
            b as u32
        } else {
            let c = next_extra;
            next_extra += 1;
            c
        };
        table[b] = match char::from_u32(code) {
            Some(c) => c,
            None => panic!("byte stand-ins are all below U+0200"),
        };
        b += 1;
    }
    table
};

/// Appends the byte-level stand-ins of `bytes` to `out`.
pub fn encode_bytes(bytes: &[u8], out: &mut String) {
    out.extend(bytes.iter().map(|&b| BYTE_TO_CHAR[b as usize]));
}

/// Maps byte-level stand-in characters back to the bytes they stand for.
///
/// Characters that are not stand-ins (which a well-formed vocabulary never holds) are kept
/// as their own UTF-8 bytes, so decoding never fails.
pub fn decode_chars(text: &str, out: &mut Vec<u8>) {
    for c in text.chars() {
        match char_to_byte(c) {
            Some(b) => out.push(b),
            None => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
}

fn char_to_byte(c: char) -> Option<u8> {
    let code = c as u32;
    if code < 256 && BYTE_TO_CHAR[code as usize] == c {
        return Some(code as u8);
    }
    BYTE_TO_CHAR.iter().position(|&s| s == c).map(|b| b as u8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mapping_is_a_bijection_that_round_trips() {
        let mut seen = std::collections::HashSet::new();
        for b in 0..=255u8 {
            assert!(seen.insert(BYTE_TO_CHAR[b as usize]));
        }
        let bytes: Vec<u8> = (0..=255).collect();
        let mut s = String::new();
        encode_bytes(&bytes, &mut s);
        let mut back = Vec::new();
        decode_chars(&s, &mut back);
        assert_eq!(back, bytes);
        // OpenAI's table maps the space to U+0120 ('Ġ') and newline to U+010A ('Ċ').
        assert_eq!(BYTE_TO_CHAR[b' ' as usize], 'Ġ');
        assert_eq!(BYTE_TO_CHAR[b'\n' as usize], 'Ċ');
    }
}
