//! A small RGB canvas: filled rectangles, text in an 8×8 bitmap font (horizontal or rotated a
//! quarter turn), and PNG encoding through the `png` crate.

use super::{PictureError, Result};

/// An sRGB colour.
pub type Rgb = [u8; 3];

/// White.
pub const WHITE: Rgb = [255, 255, 255];
/// The colour of text and frames.
pub const INK: Rgb = [32, 32, 32];
/// A light grey for frames and backgrounds.
pub const GREY: Rgb = [200, 200, 200];

/// The most pixels one picture may have (64 Mpx, 192 MB of RGB).
pub const MAX_PIXELS: usize = 1 << 26;

/// Width and height in pixels of one character at scale 1.
pub const GLYPH: usize = 8;

/// A rectangle in pixels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rect {
    /// Left edge.
    pub x: usize,
    /// Top edge.
    pub y: usize,
    /// Width.
    pub w: usize,
    /// Height.
    pub h: usize,
}

impl Rect {
    /// The pixel at the centre.
    pub fn centre(&self) -> (usize, usize) {
        (self.x + self.w / 2, self.y + self.h / 2)
    }
}

/// An RGB image in memory.
#[derive(Clone, Debug)]
pub struct Canvas {
    width: usize,
    height: usize,
    pixels: Vec<u8>,
}

impl Canvas {
    /// A `width × height` canvas filled with `background`; an error when larger than
    /// [`MAX_PIXELS`] or empty.
    pub fn new(width: usize, height: usize, background: Rgb, what: &str) -> Result<Canvas> {
        let area = width.checked_mul(height).filter(|&a| a <= MAX_PIXELS && a > 0);
        let Some(area) = area else {
            return Err(PictureError::TooLarge {
                what: what.to_string(),
                detail: format!("{width}x{height} pixels, more than the {MAX_PIXELS} pixels one picture may have (or empty)"),
            });
        };
        let mut pixels = Vec::new();
        pixels.try_reserve_exact(area * 3).map_err(|_| PictureError::TooLarge {
            what: what.to_string(),
            detail: format!("{width}x{height} pixels do not fit in memory"),
        })?;
        for _ in 0..area {
            pixels.extend_from_slice(&background);
        }
        Ok(Canvas { width, height, pixels })
    }

    /// Width in pixels.
    pub fn width(&self) -> usize {
        self.width
    }

    /// Height in pixels.
    pub fn height(&self) -> usize {
        self.height
    }

    /// The colour at (`x`, `y`); white outside.
    pub fn get(&self, x: usize, y: usize) -> Rgb {
        if x >= self.width || y >= self.height {
            return WHITE;
        }
        let k = (y * self.width + x) * 3;
        [self.pixels[k], self.pixels[k + 1], self.pixels[k + 2]]
    }

    /// Sets one pixel; outside the canvas does nothing.
    pub fn set(&mut self, x: usize, y: usize, c: Rgb) {
        if x < self.width && y < self.height {
            let k = (y * self.width + x) * 3;
            self.pixels[k..k + 3].copy_from_slice(&c);
        }
    }

    /// Fills a rectangle (clipped to the canvas).
    pub fn fill(&mut self, r: Rect, c: Rgb) {
        let (x1, y1) = ((r.x + r.w).min(self.width), (r.y + r.h).min(self.height));
        for y in r.y.min(y1)..y1 {
            for x in r.x.min(x1)..x1 {
                let k = (y * self.width + x) * 3;
                self.pixels[k..k + 3].copy_from_slice(&c);
            }
        }
    }

    /// Draws a one-pixel frame just outside `r`.
    pub fn frame(&mut self, r: Rect, c: Rgb) {
        let (x0, y0) = (r.x.saturating_sub(1), r.y.saturating_sub(1));
        let (w, h) = (r.w + (r.x - x0) + 1, r.h + (r.y - y0) + 1);
        self.fill(Rect { x: x0, y: y0, w, h: 1 }, c);
        self.fill(Rect { x: x0, y: y0 + h - 1, w, h: 1 }, c);
        self.fill(Rect { x: x0, y: y0, w: 1, h }, c);
        self.fill(Rect { x: x0 + w - 1, y: y0, w: 1, h }, c);
    }

    /// Writes `text` with its top-left corner at (`x`, `y`), each font pixel `scale` pixels.
    pub fn text(&mut self, x: usize, y: usize, text: &str, scale: usize, c: Rgb) {
        for (along, row) in ink(text) {
            self.fill(Rect { x: x + along * scale, y: y + row * scale, w: scale, h: scale }, c);
        }
    }

    /// Writes `text` turned a quarter turn anticlockwise (read bottom to top), its baseline
    /// on the right: the text's first character's bottom-left corner is at (`x`, `y`).
    pub fn text_up(&mut self, x: usize, y: usize, text: &str, scale: usize, c: Rgb) {
        for (along, row) in ink(text) {
            // Font pixel (along, row) goes to (row, -along) from the text's corner.
            let Some(py) = (y + 1).checked_sub((along + 1) * scale) else { continue };
            self.fill(Rect { x: x + row * scale, y: py, w: scale, h: scale }, c);
        }
    }

    /// The canvas as a PNG file (8-bit RGB).
    pub fn to_png(&self) -> Result<Vec<u8>> {
        let mut bytes = Vec::new();
        let err = |e: png::EncodingError| PictureError::Encode(e.to_string());
        let (w, h) = (u32::try_from(self.width), u32::try_from(self.height));
        let (Ok(w), Ok(h)) = (w, h) else { return Err(PictureError::Encode("the picture is too wide".into())) };
        let mut encoder = png::Encoder::new(&mut bytes, w, h);
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        let mut writer = encoder.write_header().map_err(err)?;
        writer.write_image_data(&self.pixels).map_err(err)?;
        writer.finish().map_err(err)?;
        Ok(bytes)
    }
}

/// Width in pixels of `text` at `scale`.
pub fn text_width(text: &str, scale: usize) -> usize {
    text.chars().count() * GLYPH * scale
}

/// The inked font pixels of `text` set in one line: (column along the line, row in the glyph).
fn ink(text: &str) -> impl Iterator<Item = (usize, usize)> + '_ {
    text.chars().enumerate().flat_map(|(n, ch)| {
        let rows = glyph(ch);
        (0..GLYPH).flat_map(move |gy| (0..GLYPH).filter(move |gx| rows[gy] & (1 << gx) != 0).map(move |gx| (n * GLYPH + gx, gy)))
    })
}

/// The 8×8 bitmap of a character (bit `x` of row `y` is the pixel at column `x`); ASCII and
/// Latin-1, `?` for anything else.
fn glyph(c: char) -> [u8; 8] {
    let code = c as usize;
    match code {
        0x20..=0x7e => font8x8::legacy::BASIC_LEGACY[code],
        0xa0..=0xff => font8x8::legacy::LATIN_LEGACY[code - 0xa0],
        _ => font8x8::legacy::BASIC_LEGACY['?' as usize],
    }
}

/// The viridis colour of `t` in `[0, 1]` (clamped; NaN is the low end).
pub fn viridis(t: f64) -> Rgb {
    let t = if t.is_nan() { 0.0 } else { t.clamp(0.0, 1.0) };
    let c = colorous::VIRIDIS.eval_continuous(t);
    [c.r, c.g, c.b]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_a_png_that_decodes_to_the_same_pixels() {
        let mut c = Canvas::new(20, 10, WHITE, "test").unwrap();
        c.fill(Rect { x: 2, y: 3, w: 4, h: 2 }, [10, 20, 30]);
        c.text(8, 1, "A", 1, INK);
        let png = c.to_png().unwrap();
        let decoder = png::Decoder::new(std::io::Cursor::new(png));
        let mut reader = decoder.read_info().unwrap();
        let mut buf = vec![0; reader.output_buffer_size().unwrap()];
        let info = reader.next_frame(&mut buf).unwrap();
        assert_eq!((info.width, info.height), (20, 10));
        assert_eq!(&buf[(3 * 20 + 2) * 3..(3 * 20 + 2) * 3 + 3], &[10, 20, 30]);
        assert_eq!(&buf[..], &c.pixels[..]);
        // 'A' has ink somewhere in its cell and nowhere left of it.
        assert!((8..16).any(|x| (1..9).any(|y| c.get(x, y) == INK)));
        assert!((0..8).all(|x| c.get(x, 2) != INK));
    }

    #[test]
    fn refuses_huge_and_empty_canvases() {
        assert!(matches!(Canvas::new(1 << 20, 1 << 20, WHITE, "x"), Err(PictureError::TooLarge { .. })));
        assert!(matches!(Canvas::new(0, 5, WHITE, "x"), Err(PictureError::TooLarge { .. })));
        assert!(matches!(Canvas::new(usize::MAX, 2, WHITE, "x"), Err(PictureError::TooLarge { .. })));
    }

    #[test]
    fn viridis_runs_from_purple_to_yellow() {
        let (lo, hi) = (viridis(0.0), viridis(1.0));
        assert!(lo[2] > lo[1] && lo[0] > lo[1], "{lo:?}");
        assert!(hi[0] > 200 && hi[1] > 200 && hi[2] < 100, "{hi:?}");
        assert_eq!(viridis(f64::NAN), lo);
        assert_eq!(viridis(7.0), hi);
    }

    #[test]
    fn vertical_text_stays_inside_and_clips() {
        let mut c = Canvas::new(16, 40, WHITE, "test").unwrap();
        c.text_up(2, 30, "ab", 1, INK);
        assert!((0..40).any(|y| (2..10).any(|x| c.get(x, y) == INK)));
        // Text running off the top is clipped, not a panic.
        c.text_up(0, 3, "long text", 2, INK);
    }
}
