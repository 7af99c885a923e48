//! The tile map picture: each flash op's compile-time tile classification as a grid of full,
//! partial and skipped tiles, one panel per op, with a legend and the share of work skipped.

use super::Result;
use super::raster::{Canvas, GLYPH, GREY, INK, Rect, Rgb, WHITE, text_width};
use attn_compiler::ir::FlashTileMap;
use attn_compiler::ir::TileClass;

/// Colour of a full tile (runs without the mask test).
pub const FULL: Rgb = [49, 104, 176];
/// Colour of a partial tile (the mask is tested per score).
pub const PARTIAL: Rgb = [240, 160, 48];
/// Colour of a skipped tile (every score masked).
pub const SKIP: Rgb = [232, 232, 232];

/// The colour of a class.
pub fn colour(class: TileClass) -> Rgb {
    match class {
        TileClass::Full => FULL,
        TileClass::Partial => PARTIAL,
        TileClass::Skip => SKIP,
    }
}

/// Panels per row of the picture.
const PANELS_PER_ROW: usize = 4;
/// The side, in pixels, a grid aims for.
const GRID_SIDE: usize = 512;
const MARGIN: usize = 24;
/// The scale of a panel's title (twice the other text).
const TITLE_SCALE: usize = 2;

/// A drawn tile map: the PNG and where each panel's grid lies, for tests and tools.
#[derive(Clone, Debug)]
pub struct TilePicture {
    /// The PNG file.
    pub png: Vec<u8>,
    /// Per panel, in the order given: the grid's rectangle and the side of one tile in pixels.
    pub grids: Vec<(Rect, usize)>,
}

/// Draws the maps (each with the name of its function) side by side, at most four a row.
pub fn tile_map_png(maps: &[(&str, &FlashTileMap)]) -> Result<TilePicture> {
    if maps.is_empty() {
        return Err(super::PictureError::Shape("there is no flash op to draw: nothing was fused into flash attention".into()));
    }
    // Tile side: about GRID_SIDE pixels for the grid, 1 to 32 pixels a tile.
    let cell = |m: &FlashTileMap| (GRID_SIDE / m.grid.rows.max(m.grid.cols).max(1)).clamp(1, 32);
    let head = 2 * GLYPH + 3 * (GLYPH + 4) + 8;
    // The width of a panel's text: the grid's, at least half of GRID_SIDE, and as wide as the
    // title (up to GRID_SIDE; longer titles are cut with "...") so that a small map keeps it.
    let text_w = |graph: &str, m: &FlashTileMap| {
        (cell(m) * m.grid.cols).max(GRID_SIDE / 2).max(text_width(&title(graph, m), TITLE_SCALE).min(GRID_SIDE))
    };
    let panel_w = |graph: &str, m: &FlashTileMap| text_w(graph, m) + 2 * GLYPH + 8;
    let panel_h = |m: &FlashTileMap| head + cell(m) * m.grid.rows;
    let rows: Vec<&[(&str, &FlashTileMap)]> = maps.chunks(PANELS_PER_ROW).collect();
    let width = rows.iter().map(|r| r.iter().map(|(g, m)| panel_w(g, m) + MARGIN).sum::<usize>()).max().unwrap_or(0) + MARGIN;
    let legend_h = 3 * GLYPH;
    let height = rows.iter().map(|r| r.iter().map(|(_, m)| panel_h(m)).max().unwrap_or(0) + MARGIN).sum::<usize>() + MARGIN + legend_h;
    let legend = "full (no mask test)   partial (mask tested)   skipped";
    let width = width.max(text_width(legend, 1) + 3 * 16 + 2 * MARGIN);
    let mut canvas = Canvas::new(width, height, WHITE, "the tile map")?;
    let mut grids = Vec::with_capacity(maps.len());
    let mut y = MARGIN;
    for row in rows {
        let mut x = MARGIN;
        for (graph, map) in row {
            grids.push(draw_panel(&mut canvas, (x, y), (graph, map), (cell(map), text_w(graph, map)), head));
            x += panel_w(graph, map) + MARGIN;
        }
        y += row.iter().map(|(_, m)| panel_h(m)).max().unwrap_or(0) + MARGIN;
    }
    draw_legend(&mut canvas, MARGIN, y);
    Ok(TilePicture { png: canvas.to_png()?, grids })
}

/// A panel's title: the function and the flash op's value.
fn title(graph: &str, map: &FlashTileMap) -> String {
    format!("{graph} %{}", map.value)
}

/// One panel: title, mask, counts, axis names and the grid, its text at most `text_w` pixels
/// wide. Returns the grid's rectangle.
fn draw_panel(
    canvas: &mut Canvas,
    (x, y): (usize, usize),
    (graph, map): (&str, &FlashTileMap),
    (cell, text_w): (usize, usize),
    head: usize,
) -> (Rect, usize) {
    let grid_w = cell * map.grid.cols;
    let cut = |s: String, chars: usize| if s.chars().count() > chars { s.chars().take(chars - 3).collect::<String>() + "..." } else { s };
    let chars = (text_w / GLYPH).max(8);
    let fit = |s: String| cut(s, chars);
    canvas.text(x, y, &cut(title(graph, map), (text_w / (GLYPH * TITLE_SCALE)).max(8)), TITLE_SCALE, INK);
    let mask = map.mask.as_deref().map_or("no mask".to_string(), |m| format!("mask: {m}"));
    canvas.text(x, y + 2 * GLYPH + 4, &fit(mask), 1, INK);
    let [skip, full, partial] = map.grid.counts();
    let (m, n) = map.grid.size;
    let (tm, tn) = map.grid.tile;
    let line = format!("{m}x{n} scores, {tm}x{tn} tiles: {:.0}% skipped", 100.0 * map.grid.skipped_share());
    canvas.text(x, y + 3 * GLYPH + 8, &fit(line), 1, INK);
    canvas.text(x, y + 4 * GLYPH + 12, &fit(format!("{full} full, {partial} partial, {skip} skipped   keys ->")), 1, INK);
    let grid = Rect { x: x + 2 * GLYPH, y: y + head, w: grid_w, h: cell * map.grid.rows };
    canvas.text_up(x, grid.y + grid.h.min(text_width("queries", 1) + 8), "queries", 1, INK);
    for r in 0..map.grid.rows {
        for c in 0..map.grid.cols {
            let rect = Rect { x: grid.x + c * cell, y: grid.y + r * cell, w: cell, h: cell };
            canvas.fill(rect, colour(map.grid.get(r, c)));
            // Tiles of 6 pixels or more get a hairline, so that single tiles can be counted.
            if cell >= 6 {
                canvas.fill(Rect { x: rect.x + cell - 1, y: rect.y, w: 1, h: cell }, WHITE);
                canvas.fill(Rect { x: rect.x, y: rect.y + cell - 1, w: cell, h: 1 }, WHITE);
            }
        }
    }
    canvas.frame(grid, GREY);
    (grid, cell)
}

fn draw_legend(canvas: &mut Canvas, x: usize, y: usize) {
    let mut x = x;
    for (colour, label) in [(FULL, "full (no mask test)"), (PARTIAL, "partial (mask tested)"), (SKIP, "skipped")] {
        let swatch = Rect { x, y, w: 12, h: 12 };
        canvas.fill(swatch, colour);
        canvas.frame(swatch, GREY);
        canvas.text(x + 16, y + 2, label, 1, INK);
        x += 16 + text_width(label, 1) + 3 * GLYPH;
    }
}
