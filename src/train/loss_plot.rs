//! A PNG plot of the training and validation loss, with no plotting dependency.
//!
//! Training loss is drawn as a blue line, validation losses as red dots, on a white canvas
//! with light grid lines at every integer loss value (every 2, 5, 10, ... when the losses span
//! too wide a range for one line per integer); the x axis is the iteration (0 to the last),
//! the y axis the loss (from the lowest to the highest value, padded). Text — tick numbers,
//! axis titles and a legend — is drawn with the small built-in font of `bitmap_font`.
//! Non-finite losses are left out.

use std::path::Path;

use super::bitmap_font::{self, ADVANCE, GLYPH_HEIGHT, GLYPH_WIDTH};

const WIDTH: usize = 800;
const HEIGHT: usize = 500;
/// Room above the plot area, for the y-axis title and the legend.
const MARGIN_TOP: usize = 50;
/// Room right of the plot area, for the last x tick label.
const MARGIN_RIGHT: usize = 30;
/// Room below the plot area, for the x tick labels and the x-axis title.
const MARGIN_BOTTOM: usize = 64;
/// The least room left of the plot area; more if a y tick label is wider.
const MIN_MARGIN_LEFT: usize = 64;
/// Each font pixel is drawn as a `TEXT_SCALE` x `TEXT_SCALE` square.
const TEXT_SCALE: usize = 2;
const TEXT_HEIGHT: usize = GLYPH_HEIGHT * TEXT_SCALE;
/// The closest two loss grid lines may be, in pixels.
const MIN_GRID_GAP: f64 = 24.0;
/// Length of the tick marks outside the axes.
const TICK: f64 = 6.0;
/// Top edge of the text in the top margin (y-axis title and legend).
const HEADER_Y: i64 = 16;

const WHITE: [u8; 3] = [255, 255, 255];
const GRID_COLOR: [u8; 3] = [225, 225, 225];
const AXIS_COLOR: [u8; 3] = [0, 0, 0];
const TEXT_COLOR: [u8; 3] = [40, 40, 40];
const TRAIN_COLOR: [u8; 3] = [31, 119, 180];
const VALID_COLOR: [u8; 3] = [214, 39, 40];

const X_TITLE: &str = "iteration";
const Y_TITLE: &str = "lm loss";
const TRAIN_LEGEND: &str = "train";
const VALID_LEGEND: &str = "validation";

struct Canvas {
    pixels: Vec<[u8; 3]>,
}

impl Canvas {
    fn new() -> Self {
        Self {
            pixels: vec![WHITE; WIDTH * HEIGHT],
        }
    }

    fn set(&mut self, x: i64, y: i64, color: [u8; 3]) {
        if x >= 0 && y >= 0 && (x as usize) < WIDTH && (y as usize) < HEIGHT {
            self.pixels[y as usize * WIDTH + x as usize] = color;
        }
    }

    fn line(&mut self, (x0, y0): (f64, f64), (x1, y1): (f64, f64), color: [u8; 3]) {
        let steps = ((x1 - x0).abs().max((y1 - y0).abs()).ceil() as usize).max(1);
        for i in 0..=steps {
            let t = i as f64 / steps as f64;
            let (x, y) = (x0 + t * (x1 - x0), y0 + t * (y1 - y0));
            self.set(x.round() as i64, y.round() as i64, color);
            self.set(x.round() as i64, y.round() as i64 + 1, color);
        }
    }

    fn dot(&mut self, (x, y): (f64, f64), color: [u8; 3]) {
        for dx in -3..=3 {
            for dy in -3..=3 {
                if dx * dx + dy * dy <= 9 {
                    self.set(x.round() as i64 + dx, y.round() as i64 + dy, color);
                }
            }
        }
    }

    /// Writes `s` with the top-left corner of its first glyph at (x, y), `TEXT_SCALE` times
    /// the font size; a character the font lacks is drawn as a hollow box.
    fn text(&mut self, x: i64, y: i64, s: &str, color: [u8; 3]) {
        let scale = TEXT_SCALE as i64;
        for (i, c) in s.chars().enumerate() {
            let left = x + (i * ADVANCE) as i64 * scale;
            let rows = bitmap_font::glyph(c).unwrap_or(bitmap_font::MISSING);
            for (row, bits) in (0i64..).zip(rows) {
                for col in 0..GLYPH_WIDTH {
                    if bits >> (GLYPH_WIDTH - 1 - col) & 1 == 0 {
                        continue;
                    }
                    let (px, py) = (left + col as i64 * scale, y + row * scale);
                    for dy in 0..scale {
                        for dx in 0..scale {
                            self.set(px + dx, py + dy, color);
                        }
                    }
                }
            }
        }
    }
}

/// Width in pixels of `s` as `Canvas::text` draws it.
fn text_width(s: &str) -> i64 {
    bitmap_font::text_width(s, TEXT_SCALE) as i64
}

/// A text to draw, by the top-left corner of its first glyph.
#[derive(Debug, Clone, PartialEq)]
struct Label {
    x: i64,
    y: i64,
    text: String,
}

/// A rectangle of pixels: left, top (inclusive), right, bottom (exclusive).
type Rect = (i64, i64, i64, i64);

impl Label {
    fn bounds(&self) -> Rect {
        let (w, h) = (text_width(&self.text), TEXT_HEIGHT as i64);
        (self.x, self.y, self.x + w, self.y + h)
    }
}

/// The sample drawn before a legend entry's text.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Marker {
    /// A stretch of training line, from (x0, y) to (x1, y).
    Line { x0: f64, x1: f64, y: f64 },
    /// A validation dot centred at (x, y).
    Dot { x: f64, y: f64 },
}

/// The smallest of 1, 2, 5, 10, 20, 50, ... that is at least `raw` (at least 1).
fn nice_step(raw: f64) -> f64 {
    if raw.is_nan() || raw <= 1.0 {
        return 1.0;
    }
    if raw.is_infinite() {
        return f64::MAX;
    }
    let mut power = 1.0;
    while power * 10.0 <= raw {
        power *= 10.0;
    }
    [1.0, 2.0, 5.0]
        .into_iter()
        .map(|m| m * power)
        .find(|&step| step >= raw)
        .unwrap_or(10.0 * power)
}

/// The multiples of `step` from `lo` to `hi` (at most 64 of them).
fn ticks(lo: f64, hi: f64, step: f64) -> Vec<f64> {
    let (first, last) = ((lo / step).ceil(), (hi / step).floor());
    let count = if last >= first {
        (last - first + 1.0).min(64.0) as usize
    } else {
        0
    };
    (0..count).map(|i| (first + i as f64) * step).collect()
}

/// A tick value (a whole number) as text: plain digits below a billion, else like `1.5e19`.
fn number_label(value: f64) -> String {
    let value = value + 0.0; // -0 becomes 0
    if value.abs() < 1e9 {
        format!("{value}")
    } else {
        format!("{value:e}")
    }
}

/// Where everything goes: the loss and iteration ranges, the plot area and the ticks.
struct Layout {
    lo: f64,
    hi: f64,
    last: f64,
    left: f64,
    right: f64,
    top: f64,
    bottom: f64,
    loss_ticks: Vec<f64>,
    iteration_ticks: Vec<f64>,
    has_validation: bool,
}

impl Layout {
    fn new(train: &[(u64, f64)], valid: &[(u64, f64)]) -> Self {
        let values = train
            .iter()
            .chain(valid)
            .map(|p| p.1)
            .filter(|v| v.is_finite());
        let (lo, hi) = values.fold((f64::MAX, f64::MIN), |(a, b), v| (a.min(v), b.max(v)));
        let (lo, hi) = if lo <= hi {
            (lo.floor().max(0.0), hi.ceil().max(lo + 1.0))
        } else {
            (0.0, 1.0)
        };
        let last = train
            .iter()
            .chain(valid)
            .map(|p| p.0)
            .max()
            .unwrap_or(1)
            .max(1) as f64;
        let (top, bottom) = (MARGIN_TOP as f64, (HEIGHT - MARGIN_BOTTOM) as f64);
        let loss_step = nice_step((hi - lo) * MIN_GRID_GAP / (bottom - top));
        let loss_ticks = ticks(lo, hi, loss_step);
        let widest = loss_ticks
            .iter()
            .map(|&v| text_width(&number_label(v)))
            .max()
            .unwrap_or(0);
        let left = MIN_MARGIN_LEFT.max(widest as usize + 2 * TICK as usize + 4) as f64;
        Self {
            lo,
            hi,
            last,
            left,
            right: (WIDTH - MARGIN_RIGHT) as f64,
            top,
            bottom,
            loss_ticks,
            iteration_ticks: ticks(0.0, last, nice_step(last / 5.0)),
            has_validation: valid.iter().any(|p| p.1.is_finite()),
        }
    }

    fn x(&self, iteration: f64) -> f64 {
        self.left + (self.right - self.left) * iteration / self.last
    }

    fn y(&self, loss: f64) -> f64 {
        self.top + (self.bottom - self.top) * (self.hi - loss) / (self.hi - self.lo)
    }

    fn at(&self, iteration: u64, loss: f64) -> (f64, f64) {
        (self.x(iteration as f64), self.y(loss))
    }

    /// Tick numbers and axis titles.
    fn labels(&self) -> Vec<Label> {
        let text_height = TEXT_HEIGHT as i64;
        let mut labels = Vec::new();
        for &loss in &self.loss_ticks {
            let text = number_label(loss);
            labels.push(Label {
                x: (self.left - 2.0 * TICK).round() as i64 - text_width(&text),
                y: self.y(loss).round() as i64 - text_height / 2,
                text,
            });
        }
        for &iteration in &self.iteration_ticks {
            let text = number_label(iteration);
            let width = text_width(&text);
            let centred = self.x(iteration).round() as i64 - width / 2;
            labels.push(Label {
                x: centred.min(WIDTH as i64 - 2 - width),
                y: (self.bottom + 2.0 * TICK).round() as i64,
                text,
            });
        }
        labels.push(Label {
            x: ((self.left + self.right) / 2.0).round() as i64 - text_width(X_TITLE) / 2,
            y: HEIGHT as i64 - 8 - text_height,
            text: X_TITLE.to_string(),
        });
        labels.push(Label {
            x: 8,
            y: HEADER_Y,
            text: Y_TITLE.to_string(),
        });
        labels
    }

    /// The legend, right-aligned in the top margin: a line sample and "train", then (if there
    /// are validation losses) a dot and "validation".
    fn legend(&self) -> Vec<(Marker, Label)> {
        const LINE_LENGTH: i64 = 24;
        const GAP: i64 = 6;
        const ENTRY_GAP: i64 = 20;
        let mut entries = vec![(LINE_LENGTH, TRAIN_LEGEND)];
        if self.has_validation {
            entries.push((7, VALID_LEGEND));
        }
        let total: i64 = entries
            .iter()
            .map(|&(marker, text)| marker + GAP + text_width(text))
            .sum::<i64>()
            + ENTRY_GAP * (entries.len() as i64 - 1);
        let middle = (HEADER_Y + TEXT_HEIGHT as i64 / 2) as f64;
        let mut x = self.right.round() as i64 - total;
        let mut legend = Vec::new();
        for (marker_width, text) in entries {
            let marker = if text == TRAIN_LEGEND {
                Marker::Line {
                    x0: x as f64,
                    x1: (x + LINE_LENGTH) as f64,
                    y: middle - 1.0,
                }
            } else {
                Marker::Dot {
                    x: (x + 3) as f64,
                    y: middle,
                }
            };
            let label = Label {
                x: x + marker_width + GAP,
                y: HEADER_Y,
                text: text.to_string(),
            };
            x = label.bounds().2 + ENTRY_GAP;
            legend.push((marker, label));
        }
        legend
    }
}

/// Draws the whole plot.
fn render(train: &[(u64, f64)], valid: &[(u64, f64)]) -> Canvas {
    let layout = Layout::new(train, valid);
    let mut canvas = Canvas::new();
    let (left, right, top, bottom) = (layout.left, layout.right, layout.top, layout.bottom);
    for &loss in &layout.loss_ticks {
        let y = layout.y(loss);
        canvas.line((left, y), (right, y), GRID_COLOR);
        canvas.line((left - TICK, y), (left, y), AXIS_COLOR);
    }
    for &iteration in &layout.iteration_ticks {
        let x = layout.x(iteration);
        canvas.line((x, bottom), (x, bottom + TICK), AXIS_COLOR);
    }
    canvas.line((left, top), (left, bottom), AXIS_COLOR);
    canvas.line((left, bottom), (right, bottom), AXIS_COLOR);
    for pair in train.windows(2) {
        let [(i0, l0), (i1, l1)] = [pair[0], pair[1]];
        if l0.is_finite() && l1.is_finite() {
            canvas.line(layout.at(i0, l0), layout.at(i1, l1), TRAIN_COLOR);
        }
    }
    for &(it, loss) in valid.iter().filter(|p| p.1.is_finite()) {
        canvas.dot(layout.at(it, loss), VALID_COLOR);
    }
    for label in layout.labels() {
        canvas.text(label.x, label.y, &label.text, TEXT_COLOR);
    }
    for (marker, label) in layout.legend() {
        match marker {
            Marker::Line { x0, x1, y } => canvas.line((x0, y), (x1, y), TRAIN_COLOR),
            Marker::Dot { x, y } => canvas.dot((x, y), VALID_COLOR),
        }
        canvas.text(label.x, label.y, &label.text, TEXT_COLOR);
    }
    canvas
}

/// Draws the curves, with tick labels, axis titles and a legend, and writes a PNG to `path`.
pub fn write_loss_plot(
    path: &Path,
    train: &[(u64, f64)],
    valid: &[(u64, f64)],
) -> std::io::Result<()> {
    let canvas = render(train, valid);
    let mut tmp = crate::atomic_file::temp_file_beside(path)?;
    std::io::Write::write_all(&mut tmp, &encode_png(&canvas.pixels, WIDTH, HEIGHT))?;
    tmp.persist(path).map_err(|e| e.error)?;
    Ok(())
}

fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = 0xffff_ffffu32;
    for &b in bytes {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xedb8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

fn chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    let start = out.len();
    out.extend_from_slice(kind);
    out.extend_from_slice(data);
    let crc = crc32(&out[start..]);
    out.extend_from_slice(&crc.to_be_bytes());
}

/// An RGB PNG with the image data in uncompressed ("stored") deflate blocks.
fn encode_png(pixels: &[[u8; 3]], width: usize, height: usize) -> Vec<u8> {
    let mut raw = Vec::with_capacity(height * (1 + 3 * width));
    for row in pixels.chunks(width) {
        raw.push(0); // filter: none
        raw.extend(row.iter().flatten());
    }
    let mut zlib = vec![0x78, 0x01];
    let blocks: Vec<&[u8]> = raw.chunks(65535).collect();
    for (i, block) in blocks.iter().enumerate() {
        zlib.push(u8::from(i + 1 == blocks.len()));
        zlib.extend_from_slice(&(block.len() as u16).to_le_bytes());
        zlib.extend_from_slice(&(!(block.len() as u16)).to_le_bytes());
        zlib.extend_from_slice(block);
    }
    let (mut a, mut b) = (1u32, 0u32);
    for &byte in &raw {
        a = (a + byte as u32) % 65521;
        b = (b + a) % 65521;
    }
    zlib.extend_from_slice(&((b << 16) | a).to_be_bytes());
    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut header = Vec::new();
    header.extend_from_slice(&(width as u32).to_be_bytes());
    header.extend_from_slice(&(height as u32).to_be_bytes());
    header.extend_from_slice(&[8, 2, 0, 0, 0]); // 8-bit RGB, no interlace
    chunk(&mut png, b"IHDR", &header);
    chunk(&mut png, b"IDAT", &zlib);
    chunk(&mut png, b"IEND", &[]);
    png
}

#[cfg(test)]
mod tests {
    use super::*;

    type Points = Vec<(u64, f64)>;

    /// A GPT-like run: loss falling from about 11 to 3 over 1000 iterations, validation
    /// every 200.
    fn sample_run() -> (Points, Points) {
        let train = (1..=1000u64)
            .map(|i| {
                (
                    i,
                    3.0 + 8.0 * (-(i as f64) / 150.0).exp() + 0.1 * (i as f64).sin(),
                )
            })
            .collect();
        let valid = (1..=5u64)
            .map(|k| (200 * k, 3.1 + 6.0 * (-(200.0 * k as f64) / 150.0).exp()))
            .collect();
        (train, valid)
    }

    /// Runs that stress the layout: typical, one point, none, huge numbers, a wide loss
    /// range, awkward iteration counts, and non-finite losses.
    fn layouts() -> Vec<(&'static str, Layout)> {
        let (train, valid) = sample_run();
        let wide: Vec<_> = (0..50u64)
            .map(|i| (i * 7, 1000.0 - 20.0 * i as f64))
            .collect();
        vec![
            ("sample", Layout::new(&train, &valid)),
            ("sample without validation", Layout::new(&train, &[])),
            ("one point", Layout::new(&[(1, 2.5)], &[])),
            ("empty", Layout::new(&[], &[])),
            (
                "huge",
                Layout::new(&[(0, 1e20), (u64::MAX, 3.0)], &[(u64::MAX / 2, 7e19)]),
            ),
            ("wide loss range", Layout::new(&wide, &wide[..3])),
            (
                "awkward iteration count",
                Layout::new(&[(0, 10.4), (1_234_567, 2.2)], &[]),
            ),
            (
                "non-finite",
                Layout::new(
                    &[(0, f64::NAN), (5, 4.0), (9, f64::INFINITY)],
                    &[(9, f64::NAN)],
                ),
            ),
        ]
    }

    fn pixel(canvas: &Canvas, x: i64, y: i64) -> [u8; 3] {
        canvas.pixels[y as usize * WIDTH + x as usize]
    }

    /// The pixels of `color` inside `rect`.
    fn count(canvas: &Canvas, (x0, y0, x1, y1): Rect, color: [u8; 3]) -> usize {
        (y0.max(0)..y1.min(HEIGHT as i64))
            .flat_map(|y| (x0.max(0)..x1.min(WIDTH as i64)).map(move |x| (x, y)))
            .filter(|&(x, y)| pixel(canvas, x, y) == color)
            .count()
    }

    impl Marker {
        /// The pixels `Canvas::line` or `Canvas::dot` may colour for this marker.
        fn bounds(&self) -> Rect {
            match *self {
                Marker::Line { x0, x1, y } => (
                    x0.round() as i64,
                    y.round() as i64,
                    x1.round() as i64 + 1,
                    y.round() as i64 + 2,
                ),
                Marker::Dot { x, y } => (
                    x.round() as i64 - 3,
                    y.round() as i64 - 3,
                    x.round() as i64 + 4,
                    y.round() as i64 + 4,
                ),
            }
        }
    }

    fn disjoint(a: Rect, b: Rect) -> bool {
        a.2 <= b.0 || b.2 <= a.0 || a.3 <= b.1 || b.3 <= a.1
    }

    fn inside(inner: Rect, outer: Rect) -> bool {
        inner.0 >= outer.0 && inner.1 >= outer.1 && inner.2 <= outer.2 && inner.3 <= outer.3
    }

    /// Decodes a PNG as `encode_png` writes it (8-bit RGB, stored deflate blocks, filter 0),
    /// checking every chunk CRC and the Adler-32.
    fn decode_png(png: &[u8]) -> (usize, usize, Vec<[u8; 3]>) {
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        let (mut pos, mut header, mut idat, mut ended) = (8, None, Vec::new(), false);
        while pos < png.len() {
            let len = u32::from_be_bytes(png[pos..pos + 4].try_into().unwrap()) as usize;
            let (kind, data) = (&png[pos + 4..pos + 8], &png[pos + 8..pos + 8 + len]);
            let crc = u32::from_be_bytes(png[pos + 8 + len..pos + 12 + len].try_into().unwrap());
            assert_eq!(crc32(&png[pos + 4..pos + 8 + len]), crc, "chunk {kind:?}");
            match kind {
                b"IHDR" => header = Some(data.to_vec()),
                b"IDAT" => idat.extend_from_slice(data),
                b"IEND" => ended = true,
                _ => panic!("unexpected chunk {kind:?}"),
            }
            pos += 12 + len;
        }
        assert!(ended);
        let header = header.expect("IHDR");
        let width = u32::from_be_bytes(header[0..4].try_into().unwrap()) as usize;
        let height = u32::from_be_bytes(header[4..8].try_into().unwrap()) as usize;
        assert_eq!(&header[8..], &[8, 2, 0, 0, 0]);
        assert_eq!(&idat[..2], &[0x78, 0x01]);
        let (mut raw, mut pos) = (Vec::new(), 2);
        loop {
            let last = idat[pos] == 1;
            let len = u16::from_le_bytes([idat[pos + 1], idat[pos + 2]]);
            let nlen = u16::from_le_bytes([idat[pos + 3], idat[pos + 4]]);
            assert_eq!(len, !nlen);
            raw.extend_from_slice(&idat[pos + 5..pos + 5 + len as usize]);
            pos += 5 + len as usize;
            if last {
                break;
            }
        }
        let (mut a, mut b) = (1u32, 0u32);
        for &byte in &raw {
            a = (a + byte as u32) % 65521;
            b = (b + a) % 65521;
        }
        assert_eq!(&idat[pos..], &((b << 16) | a).to_be_bytes());
        assert_eq!(raw.len(), height * (1 + 3 * width));
        let mut pixels = Vec::new();
        for row in raw.chunks(1 + 3 * width) {
            assert_eq!(row[0], 0, "filter type");
            pixels.extend(row[1..].chunks(3).map(|p| [p[0], p[1], p[2]]));
        }
        (width, height, pixels)
    }

    #[test]
    fn crc_matches_the_png_specification_example() {
        // CRC-32 of "IEND" as it appears in every PNG.
        assert_eq!(crc32(b"IEND"), 0xae42_6082);
    }

    #[test]
    fn every_label_character_is_in_the_font() {
        let mut texts: Vec<String> = [X_TITLE, Y_TITLE, TRAIN_LEGEND, VALID_LEGEND]
            .map(String::from)
            .to_vec();
        for (_, layout) in layouts() {
            texts.extend(layout.labels().into_iter().map(|l| l.text));
            texts.extend(layout.legend().into_iter().map(|(_, l)| l.text));
        }
        let mut value = 1.0f64;
        while value.is_finite() {
            texts.push(number_label(value));
            texts.push(number_label(value * 1.5));
            value *= 10.0;
        }
        texts.push(number_label(u64::MAX as f64));
        for text in &texts {
            for c in text.chars() {
                assert!(bitmap_font::glyph(c).is_some(), "{c:?} of {text:?}");
            }
        }
    }

    #[test]
    fn number_labels_are_plain_below_a_billion_then_scientific() {
        assert_eq!(number_label(0.0), "0");
        assert_eq!(number_label(-0.0), "0");
        assert_eq!(number_label(11.0), "11");
        assert_eq!(number_label(500_000.0), "500000");
        assert_eq!(number_label(999_999_999.0), "999999999");
        assert_eq!(number_label(1e9), "1e9");
        assert_eq!(number_label(1.5e19), "1.5e19");
    }

    #[test]
    fn nice_steps_and_ticks() {
        let steps = [0.0, 0.3, 1.0, 1.1, 2.5, 7.0, 200.0, 201.0, 4e18, f64::NAN];
        assert_eq!(
            steps.map(nice_step),
            [1.0, 1.0, 1.0, 2.0, 5.0, 10.0, 200.0, 500.0, 5e18, 1.0]
        );
        assert_eq!(nice_step(f64::INFINITY), f64::MAX);
        assert_eq!(
            ticks(0.0, 1000.0, 200.0),
            [0.0, 200.0, 400.0, 600.0, 800.0, 1000.0]
        );
        assert_eq!(ticks(3.0, 11.0, 5.0), [5.0, 10.0]);
        assert_eq!(ticks(6.0, 9.0, 5.0), Vec::<f64>::new());
        assert_eq!(ticks(0.0, 1e300, 1.0).len(), 64);
    }

    #[test]
    fn grid_stays_at_every_integer_loss_for_usual_losses() {
        let (train, valid) = sample_run();
        let layout = Layout::new(&train, &valid);
        let expected: Vec<f64> = (2..=12).map(f64::from).collect();
        assert_eq!(layout.loss_ticks, expected);
        assert_eq!(
            layout.iteration_ticks,
            [0.0, 200.0, 400.0, 600.0, 800.0, 1000.0]
        );
        let canvas = render(&train, &valid);
        // Near the right end, where the curve is down at about 3.
        let x = layout.right as i64 - 5;
        for loss in [4.0, 7.0, 12.0] {
            let y = layout.y(loss).round() as i64;
            let near = (y - 1..=y + 2)
                .map(|y| pixel(&canvas, x, y))
                .collect::<Vec<_>>();
            assert!(near.contains(&GRID_COLOR), "no grid line at loss {loss}");
        }
    }

    #[test]
    fn text_stays_in_its_box_and_draws_every_glyph() {
        let mut canvas = Canvas::new();
        let text = "lm loss 1.5e+9-0";
        let (x, y) = (100, 200);
        canvas.text(x, y, text, TEXT_COLOR);
        let label = Label {
            x,
            y,
            text: text.to_string(),
        };
        let bounds = label.bounds();
        assert_eq!(bounds, (x, y, x + 190, y + 14));
        let ink = count(&canvas, (0, 0, WIDTH as i64, HEIGHT as i64), TEXT_COLOR);
        assert_eq!(
            ink,
            count(&canvas, bounds, TEXT_COLOR),
            "ink outside the box"
        );
        assert_eq!(
            ink + count(&canvas, (0, 0, WIDTH as i64, HEIGHT as i64), WHITE),
            WIDTH * HEIGHT
        );
        let cell = (ADVANCE * TEXT_SCALE) as i64;
        for (i, c) in text.chars().enumerate() {
            let left = x + i as i64 * cell;
            let glyph_ink = count(&canvas, (left, y, left + cell, y + 14), TEXT_COLOR);
            assert_eq!(glyph_ink == 0, c == ' ', "{c:?} at {i}");
            // Every font pixel is a whole TEXT_SCALE x TEXT_SCALE square.
            assert_eq!(glyph_ink % (TEXT_SCALE * TEXT_SCALE), 0, "{c:?}");
        }
        // The gap column after each glyph stays blank.
        for i in 0..text.chars().count() as i64 {
            let gap = x + i * cell + (GLYPH_WIDTH * TEXT_SCALE) as i64;
            assert_eq!(count(&canvas, (gap, y, gap + 2, y + 14), TEXT_COLOR), 0);
        }
    }

    #[test]
    fn a_character_outside_the_font_is_drawn_as_a_box() {
        let mut canvas = Canvas::new();
        canvas.text(10, 10, "?", TEXT_COLOR);
        // The box's outline: 2 * 5 + 2 * 5 font pixels, each 2x2.
        assert_eq!(count(&canvas, (10, 10, 20, 24), TEXT_COLOR), 20 * 4);
    }

    #[test]
    fn labels_and_legend_fit_the_canvas_without_overlapping() {
        let canvas_rect = (0, 0, WIDTH as i64, HEIGHT as i64);
        for (name, layout) in layouts() {
            let plot = (
                layout.left as i64,
                layout.top as i64,
                layout.right as i64 + 1,
                layout.bottom as i64 + 2,
            );
            let mut rects: Vec<(String, Rect)> = layout
                .labels()
                .into_iter()
                .map(|l| (l.text.clone(), l.bounds()))
                .collect();
            for (marker, label) in layout.legend() {
                rects.push((format!("{marker:?}"), marker.bounds()));
                rects.push((label.text.clone(), label.bounds()));
            }
            for (i, (text, rect)) in rects.iter().enumerate() {
                assert!(inside(*rect, canvas_rect), "{name}: {text:?} {rect:?}");
                assert!(disjoint(*rect, plot), "{name}: {text:?} in the plot area");
                for (other, other_rect) in &rects[i + 1..] {
                    assert!(
                        disjoint(*rect, *other_rect),
                        "{name}: {text:?} overlaps {other:?}"
                    );
                }
            }
            assert!((2..=17).contains(&layout.loss_ticks.len()), "{name}");
            assert!((2..=6).contains(&layout.iteration_ticks.len()), "{name}");
        }
    }

    #[test]
    fn legend_lists_validation_only_when_there_are_validation_losses() {
        let (train, valid) = sample_run();
        let header = (0, 0, WIDTH as i64, MARGIN_TOP as i64 - 10);
        let with = render(&train, &valid);
        let without = render(&train, &[]);
        let only_nan = render(&train, &[(5, f64::NAN)]);
        for canvas in [&with, &without, &only_nan] {
            assert!(count(canvas, header, TRAIN_COLOR) > 0);
        }
        assert!(count(&with, header, VALID_COLOR) > 0);
        assert_eq!(count(&without, header, VALID_COLOR), 0);
        assert_eq!(count(&only_nan, header, VALID_COLOR), 0);
        assert!(count(&with, header, TEXT_COLOR) > count(&without, header, TEXT_COLOR));
        assert_eq!(Layout::new(&train, &valid).legend().len(), 2);
        assert_eq!(Layout::new(&train, &[]).legend().len(), 1);
    }

    #[test]
    fn plot_png_decodes_to_the_rendered_canvas_with_labels() {
        let (train, valid) = sample_run();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("loss.png");
        write_loss_plot(&path, &train, &valid).unwrap();
        let (width, height, pixels) = decode_png(&std::fs::read(&path).unwrap());
        assert_eq!((width, height), (WIDTH, HEIGHT));
        let canvas = render(&train, &valid);
        assert!(pixels == canvas.pixels, "PNG differs from the canvas");
        let layout = Layout::new(&train, &valid);
        let left_of_axis = (
            0,
            MARGIN_TOP as i64 - 10,
            layout.left as i64 - 8,
            HEIGHT as i64,
        );
        let below_axis = (0, layout.bottom as i64 + 8, WIDTH as i64, HEIGHT as i64);
        assert!(
            count(&canvas, left_of_axis, TEXT_COLOR) > 0,
            "no y tick labels"
        );
        assert!(
            count(&canvas, below_axis, TEXT_COLOR) > 0,
            "no x tick labels"
        );
        assert!(count(&canvas, (0, 0, WIDTH as i64, HEIGHT as i64), TRAIN_COLOR) > 1000);
    }

    #[test]
    fn non_finite_losses_are_left_out() {
        let train = [
            (0, f64::NAN),
            (1, 5.0),
            (2, f64::INFINITY),
            (3, 4.0),
            (4, 3.0),
        ];
        let valid = [(2, f64::NEG_INFINITY), (4, 3.5), (4, f64::NAN)];
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("loss.png");
        write_loss_plot(&path, &train, &valid).unwrap();
        let (width, height, pixels) = decode_png(&std::fs::read(&path).unwrap());
        assert_eq!(
            (width, height, pixels.len()),
            (WIDTH, HEIGHT, WIDTH * HEIGHT)
        );
        let layout = Layout::new(&train, &valid);
        assert_eq!((layout.lo, layout.hi), (3.0, 5.0));
        // The one finite validation loss is the only dot outside the legend.
        let plot = (0, MARGIN_TOP as i64, WIDTH as i64, HEIGHT as i64);
        let canvas = render(&train, &valid);
        assert_eq!(count(&canvas, plot, VALID_COLOR), 29);
    }
}
