//! A PNG plot of the training and validation loss, with no plotting dependency.
//!
//! Training loss is drawn as a blue line, validation losses as red dots, on a white canvas
//! with light grid lines at every integer loss value; the x axis is the iteration (0 to the
//! last), the y axis the loss (from the lowest to the highest value, padded).

use std::path::Path;

const WIDTH: usize = 800;
const HEIGHT: usize = 500;
const MARGIN: usize = 40;

struct Canvas {
    pixels: Vec<[u8; 3]>,
}

impl Canvas {
    fn new() -> Self {
        Self {
            pixels: vec![[255, 255, 255]; WIDTH * HEIGHT],
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
}

/// Draws the curves and writes a PNG to `path`.
pub fn write_loss_plot(
    path: &Path,
    train: &[(u64, f64)],
    valid: &[(u64, f64)],
) -> std::io::Result<()> {
    let mut canvas = Canvas::new();
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
    let (w, h) = ((WIDTH - 2 * MARGIN) as f64, (HEIGHT - 2 * MARGIN) as f64);
    let at = |it: u64, loss: f64| {
        (
            MARGIN as f64 + w * it as f64 / last,
            MARGIN as f64 + h * (hi - loss) / (hi - lo),
        )
    };
    for k in lo as i64..=hi as i64 {
        let y = at(0, k as f64).1;
        canvas.line(
            (MARGIN as f64, y),
            ((WIDTH - MARGIN) as f64, y),
            [225, 225, 225],
        );
    }
    let axis = [0, 0, 0];
    canvas.line(
        (MARGIN as f64, MARGIN as f64),
        (MARGIN as f64, (HEIGHT - MARGIN) as f64),
        axis,
    );
    canvas.line(
        (MARGIN as f64, (HEIGHT - MARGIN) as f64),
        ((WIDTH - MARGIN) as f64, (HEIGHT - MARGIN) as f64),
        axis,
    );
    for pair in train.windows(2) {
        canvas.line(
            at(pair[0].0, pair[0].1),
            at(pair[1].0, pair[1].1),
            [31, 119, 180],
        );
    }
    for &(it, loss) in valid {
        canvas.dot(at(it, loss), [214, 39, 40]);
    }
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

    #[test]
    fn crc_matches_the_png_specification_example() {
        // CRC-32 of "IEND" as it appears in every PNG.
        assert_eq!(crc32(b"IEND"), 0xae42_6082);
    }
}
