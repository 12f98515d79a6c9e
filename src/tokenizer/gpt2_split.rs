//! The GPT-2 pre-tokenizer, matched by hand.
//!
//! GPT-2 (and Megatron's `GPT2BPETokenizer`) cut text into pre-tokens with the regex
//! `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+` before BPE.
//! Running that regex (with its look-ahead) is the slowest part of the `tokenizers` pipeline, so
//! this module walks the text once and reproduces the regex's leftmost-first matches exactly.
//! Exactness is checked in the tests against `tokenizers`' own `ByteLevel` pre-tokenizer.

use unicode_general_category::{get_general_category, GeneralCategory};

/// The character classes the GPT-2 pattern distinguishes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CharClass {
    /// `\p{L}`: any letter (general category L*).
    Letter,
    /// `\p{N}`: any number (general categories Nd, Nl, No).
    Number,
    /// `\s`: Unicode white space.
    Space,
    /// Everything else: `[^\s\p{L}\p{N}]`.
    Other,
}

/// Class of every ASCII character, so that the common case is one table lookup.
const ASCII_CLASSES: [CharClass; 128] = {
    let mut table = [CharClass::Other; 128];
    let mut b = 0;
    while b < 128 {
        let c = b as u8;
        table[b] = if c.is_ascii_alphabetic() {
            CharClass::Letter
        } else if c.is_ascii_digit() {
            CharClass::Number
        } else if matches!(c, b'\t' | b'\n' | 0x0b | 0x0c | b'\r' | b' ') {
            CharClass::Space
        } else {
            CharClass::Other
        };
        b += 1;
    }
    table
};

fn classify(c: char) -> CharClass {
    if c.is_ascii() {
        return ASCII_CLASSES[c as usize];
    }
    // Oniguruma's Unicode `\s` is U+0009..U+000D, U+0085 and categories Zs/Zl/Zp, which is
    // exactly the White_Space property that `char::is_whitespace` implements.
    if c.is_whitespace() {
        return CharClass::Space;
    }
    use GeneralCategory::*;
    match get_general_category(c) {
        UppercaseLetter | LowercaseLetter | TitlecaseLetter | ModifierLetter | OtherLetter => {
            CharClass::Letter
        }
        DecimalNumber | LetterNumber | OtherNumber => CharClass::Number,
        _ => CharClass::Other,
    }
}

/// Decodes the character starting at byte `pos` of `text`, with its class and UTF-8 length.
#[inline]
fn char_at(text: &str, pos: usize) -> Option<(CharClass, usize)> {
    let b = *text.as_bytes().get(pos)?;
    if b < 0x80 {
        return Some((ASCII_CLASSES[b as usize], 1));
    }
    let c = text[pos..].chars().next()?;
    Some((classify(c), c.len_utf8()))
}

/// Length of a contraction suffix (`s t re ve m ll d`) at the start of `rest`, if any.
fn contraction_len(rest: &[u8]) -> Option<usize> {
    match rest {
        [b'r', b'e', ..] | [b'v', b'e', ..] | [b'l', b'l', ..] => Some(2),
        [b's' | b't' | b'm' | b'd', ..] => Some(1),
        _ => None,
    }
}

/// Iterator over the GPT-2 pre-tokens of a text, as sub-slices of it.
///
/// The pre-tokens cover the text exactly, in order, with nothing dropped.
#[derive(Clone, Debug)]
pub struct Gpt2PreTokens<'a> {
    text: &'a str,
    pos: usize,
}

impl<'a> Gpt2PreTokens<'a> {
    /// Starts splitting `text` from its beginning.
    pub fn new(text: &'a str) -> Self {
        Self { text, pos: 0 }
    }

    /// End of the run of characters of class `class` that starts at `pos`.
    #[inline]
    fn run_end(&self, mut pos: usize, class: CharClass) -> usize {
        while let Some((c, len)) = char_at(self.text, pos) {
            if c != class {
                break;
            }
            pos += len;
        }
        pos
    }

    /// Where the pre-token starting at `start` ends.
    fn token_end(&self, start: usize) -> usize {
        let bytes = self.text.as_bytes();
        let Some((class, len)) = char_at(self.text, start) else {
            return start;
        };
        // 's|'t|'re|'ve|'m|'ll|'d come first in the alternation.
        if bytes[start] == b'\'' {
            if let Some(n) = contraction_len(&bytes[start + 1..]) {
                return start + 1 + n;
            }
        }
        // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`: an optional single ASCII space, then a
        // run of one class. A space followed by a non-space always starts such a token.
        let (run_start, run_class) = if bytes[start] == b' ' {
            match char_at(self.text, start + 1) {
                Some((next, _)) if next != CharClass::Space => (start + 1, next),
                _ => (start, CharClass::Space),
            }
        } else {
            (start, class)
        };
        if run_class != CharClass::Space {
            let first_len = if run_start == start {
                len
            } else {
                char_at(self.text, run_start).map_or(0, |(_, l)| l)
            };
            return self.run_end(run_start + first_len, run_class);
        }
        // `\s+(?!\S)|\s+`: a white-space run that reaches the end of the text is one token;
        // one followed by a non-space gives back its last character (which then starts the
        // next token), unless it is a single character.
        let end = self.run_end(start, CharClass::Space);
        if end == bytes.len() {
            return end;
        }
        let last_start = self.text[..end]
            .char_indices()
            .next_back()
            .map_or(start, |(i, _)| i);
        if last_start > start {
            last_start
        } else {
            end
        }
    }
}

impl<'a> Iterator for Gpt2PreTokens<'a> {
    type Item = &'a str;

    #[inline]
    fn next(&mut self) -> Option<&'a str> {
        if self.pos >= self.text.len() {
            return None;
        }
        let start = self.pos;
        let end = self.token_end(start);
        debug_assert!(
            end > start,
            "GPT-2 pre-tokenizer made no progress at byte {start}"
        );
        self.pos = end;
        Some(&self.text[start..end])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(s: &str) -> Vec<&str> {
        Gpt2PreTokens::new(s).collect()
    }

    #[test]
    fn splits_like_the_gpt2_regex_on_hand_checked_cases() {
        assert_eq!(split("Hello world"), ["Hello", " world"]);
        assert_eq!(split("don't"), ["don", "'t"]);
        assert_eq!(split("they'RE"), ["they", "'", "RE"]);
        assert_eq!(split("''s"), ["''", "s"]);
        assert_eq!(split("a  b"), ["a", " ", " b"]);
        assert_eq!(split("a \n\nb"), ["a", " \n", "\n", "b"]);
        assert_eq!(split("a\nb"), ["a", "\n", "b"]);
        assert_eq!(split("end.  "), ["end", ".", "  "]);
        assert_eq!(split(" 123abc"), [" 123", "abc"]);
        assert_eq!(split("<|endoftext|>"), ["<|", "endoftext", "|>"]);
        assert_eq!(split("naïve café"), ["naïve", " café"]);
        assert_eq!(split(""), Vec::<&str>::new());
    }
}
