//! A tiny 5x7 bitmap font for the loss plot's labels, so drawing text needs no font dependency.

/// Width of a glyph in font pixels.
pub const GLYPH_WIDTH: usize = 5;

/// Height of a glyph in font pixels.
pub const GLYPH_HEIGHT: usize = 7;

/// Horizontal distance from one character to the next, in font pixels (the glyph and one
/// blank column).
pub const ADVANCE: usize = GLYPH_WIDTH + 1;

/// A glyph's rows, top to bottom; in each row bit 4 (`0x10`) is the leftmost column and bit 0
/// the rightmost.
pub type Glyph = [u8; GLYPH_HEIGHT];

/// A hollow box, drawn in place of a character the font lacks so it cannot vanish silently.
pub const MISSING: Glyph = [0x1F, 0x11, 0x11, 0x11, 0x11, 0x11, 0x1F];

// Only what the plot writes: the digits and signs of a formatted number (`0-9 . - + e`), the
// space, and the lower-case letters of "iteration", "lm loss", "train" and "validation".
const GLYPHS: &[(char, Glyph)] = &[
    (' ', [0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00]),
    ('0', [0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E]),
    ('1', [0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E]),
    ('2', [0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F]),
    ('3', [0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E]),
    ('4', [0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02]),
    ('5', [0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E]),
    ('6', [0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E]),
    ('7', [0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08]),
    ('8', [0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E]),
    ('9', [0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C]),
    ('.', [0x00, 0x00, 0x00, 0x00, 0x00, 0x0C, 0x0C]),
    ('-', [0x00, 0x00, 0x00, 0x1F, 0x00, 0x00, 0x00]),
    ('+', [0x00, 0x04, 0x04, 0x1F, 0x04, 0x04, 0x00]),
    ('a', [0x00, 0x00, 0x0E, 0x01, 0x0F, 0x11, 0x0F]),
    ('d', [0x01, 0x01, 0x0D, 0x13, 0x11, 0x11, 0x0F]),
    ('e', [0x00, 0x00, 0x0E, 0x11, 0x1F, 0x10, 0x0E]),
    ('i', [0x04, 0x00, 0x0C, 0x04, 0x04, 0x04, 0x0E]),
    ('l', [0x0C, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E]),
    ('m', [0x00, 0x00, 0x1A, 0x15, 0x15, 0x15, 0x15]),
    ('n', [0x00, 0x00, 0x16, 0x19, 0x11, 0x11, 0x11]),
    ('o', [0x00, 0x00, 0x0E, 0x11, 0x11, 0x11, 0x0E]),
    ('r', [0x00, 0x00, 0x16, 0x19, 0x10, 0x10, 0x10]),
    ('s', [0x00, 0x00, 0x0F, 0x10, 0x0E, 0x01, 0x1E]),
    ('t', [0x08, 0x08, 0x1C, 0x08, 0x08, 0x09, 0x06]),
    ('v', [0x00, 0x00, 0x11, 0x11, 0x11, 0x0A, 0x04]),
];

/// The glyph for `c`, or `None` if the font does not have it.
pub fn glyph(c: char) -> Option<Glyph> {
    GLYPHS.iter().find(|(g, _)| *g == c).map(|(_, rows)| *rows)
}

/// Width in pixels of `text` drawn with every font pixel `scale` pixels wide (no trailing
/// blank column; 0 for an empty string).
pub fn text_width(text: &str, scale: usize) -> usize {
    let chars = text.chars().count();
    (chars * ADVANCE).saturating_sub(ADVANCE - GLYPH_WIDTH) * scale
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glyph_rows_stay_within_the_glyph_width() {
        for (c, rows) in GLYPHS.iter().chain([&('?', MISSING)]) {
            for row in rows {
                assert_eq!(row >> GLYPH_WIDTH, 0, "glyph {c:?} has a row wider than 5");
            }
        }
    }

    #[test]
    fn every_glyph_but_the_space_has_ink_and_no_two_look_alike() {
        for (i, (c, rows)) in GLYPHS.iter().enumerate() {
            assert_eq!(*c == ' ', rows.iter().all(|&r| r == 0), "glyph {c:?}");
            assert_ne!(
                *rows, MISSING,
                "glyph {c:?} looks like the missing-glyph box"
            );
            for (d, other) in &GLYPHS[i + 1..] {
                assert_ne!(c, d, "{c:?} is in the font twice");
                assert_ne!(rows, other, "{c:?} and {d:?} are drawn the same");
            }
        }
    }

    #[test]
    fn lookup_finds_listed_characters_and_rejects_others() {
        assert_eq!(glyph('1'), Some([0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E]));
        assert_ne!(glyph('l'), glyph('1'));
        for c in ['X', 'q', 'E', '?', 'é', '\n'] {
            assert_eq!(glyph(c), None, "{c:?}");
        }
    }

    #[test]
    fn text_width_counts_glyphs_and_gaps() {
        assert_eq!(text_width("", 2), 0);
        assert_eq!(text_width("1", 1), 5);
        assert_eq!(text_width("10", 1), 11);
        assert_eq!(text_width("train", 2), 58);
    }
}
