//! The tile maps of a graph's flash ops at concrete sizes: which (query block, key tile) pairs
//! the kernels skip, run in full or test against the mask ([`super::classify_tile`]), as data
//! for `attnc explain` and its pictures, and as the block census printed after the optimised IR
//! (comments the IR reader skips).

use super::{Graph, Op, ShowExpr, TileClass, TileGrid, grid_size, tile_grid, value_numbers};
use std::collections::HashMap;
use std::fmt::{self, Write};

/// The size a dim takes where no size is given (the cost model's and the tile maps'
/// representative sizes): sequence-like names (`S`, `N`, `M`, `T`, `L`) 1024, batches 2, heads
/// 8, anything else 64.
pub fn representative(name: &str) -> i64 {
    match name.chars().next() {
        Some('S' | 'N' | 'M' | 'T' | 'L') => 1024,
        Some('B') => 2,
        Some('H' | 'G') => 8,
        _ => 64,
    }
}

/// Tile size the classification summary and the default tile maps use.
pub const MAP_TILE: i64 = 64;

/// The most tiles one map may have (1024 × 1024): beyond it, classifying and drawing them takes
/// longer than a person waits.
pub const MAX_MAP_TILES: usize = 1 << 20;

/// Why a tile map cannot be made.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum TileMapError {
    /// More tiles than [`MAX_MAP_TILES`].
    #[error(
        "the tile map of %{value} has {rows}x{cols} tiles ({m}x{n} scores in {tm}x{tn} tiles), more than the {limit} drawn; use larger tiles or smaller dims"
    )]
    TooLarge {
        /// The flash op's value number.
        value: usize,
        /// Tiles down.
        rows: usize,
        /// Tiles across.
        cols: usize,
        /// Scores down.
        m: i64,
        /// Scores across.
        n: i64,
        /// Tile rows.
        tm: i64,
        /// Tile columns.
        tn: i64,
        /// [`MAX_MAP_TILES`].
        limit: usize,
    },
}

/// One flash op's compile-time tile classification at concrete sizes.
#[derive(Clone, Debug, PartialEq)]
pub struct FlashTileMap {
    /// The flash op's value number (`%N` in the optimised IR).
    pub value: usize,
    /// Its score modification, as in the text form.
    pub score: String,
    /// Its mask predicate; `None` keeps every key.
    pub mask: Option<String>,
    /// The sizes of its batch axes.
    pub batch: Vec<i64>,
    /// The classes of its tiles.
    pub grid: TileGrid,
    /// True when the classes come from input data (the interpreter's `data_tile_grids`), not
    /// from the compile-time analysis alone.
    pub from_data: bool,
}

/// The tile maps of every flash op of `g`, at the sizes in `dims` (a dim not given takes its
/// representative size, as in the cost model) with `tile`-sized tiles.
pub fn flash_tile_maps(g: &Graph, dims: &HashMap<String, i64>, tile: (i64, i64)) -> Result<Vec<FlashTileMap>, TileMapError> {
    let numbers = value_numbers(g);
    let mut order = g.topo_order().unwrap_or_default();
    order.sort_by_key(|v| numbers[v.index()]);
    let mut maps = Vec::new();
    for v in order {
        let Op::Flash(spec) = &g.node(v).op else { continue };
        let ops = g.operands(v);
        let (qt, kt) = (&g.node(ops[0]).ty, &g.node(ops[1]).ty);
        let r = spec.rank;
        let mut env: HashMap<String, i64> = dims.clone();
        for d in qt.shape.iter().chain(&kt.shape) {
            for s in d.symbols() {
                let size = representative(&s);
                env.entry(s).or_insert(size);
            }
        }
        let size = |d: &super::Dim| d.eval(&env).unwrap_or(1);
        let batch: Vec<i64> = qt.shape[..r - 2].iter().map(size).collect();
        let (m, n) = (size(&qt.shape[r - 2]), size(&kt.shape[r - 2]));
        let value = numbers[v.index()];
        let (rows, cols) = grid_size((m, n), tile);
        if rows.saturating_mul(cols) > MAX_MAP_TILES {
            let (tm, tn) = tile;
            return Err(TileMapError::TooLarge { value, rows, cols, m, n, tm, tn, limit: MAX_MAP_TILES });
        }
        let grid = tile_grid(spec.mask.as_ref(), &batch, (m, n), tile, &env);
        let show = |e: &super::ScoreExpr| ShowExpr { expr: e, rank: r }.to_string();
        maps.push(FlashTileMap { value, score: show(&spec.score), mask: spec.mask.as_ref().map(show), batch, grid, from_data: false });
    }
    Ok(maps)
}

/// `# %N: …` lines classifying the 64×64 tiles of every flash op at representative sizes, with
/// the share of the scores skipped as `explain` reports it ([`FlashTileMap::summary`]).
pub fn block_summary(g: &Graph) -> String {
    let mut out = String::new();
    for map in flash_tile_maps(g, &HashMap::new(), (MAP_TILE, MAP_TILE)).unwrap_or_default() {
        let [skip, full, partial] = map.grid.counts();
        let (m, n) = map.grid.size;
        let _ = writeln!(
            out,
            "# %{}: {MAP_TILE}x{MAP_TILE} tiles at {m}x{n} scores: {full} full, {partial} partial (mask tested), {skip} skipped; {} of the scores skipped",
            map.value,
            percent(map.grid.skipped_share())
        );
    }
    out
}

/// A share as a percentage, whole unless that would round a share that is not 0 or 1 to 0% or
/// 100% (a chunked mask skips 99.8% of a long sequence's tiles, not all of them).
fn percent(share: f64) -> String {
    let p = 100.0 * share;
    for decimals in 0..4 {
        let text = format!("{p:.decimals$}");
        let rounded: f64 = text.parse().unwrap_or(p);
        if (rounded != 0.0 || p == 0.0) && (rounded != 100.0 || p == 100.0) {
            return format!("{text}%");
        }
    }
    format!("{p:.4}%")
}

/// The most characters a text map is wide and tall; larger maps are downsampled.
pub const MAX_TEXT_SIDE: usize = 64;

/// Characters of the text map: full, partial, skipped.
const GLYPHS: [char; 3] = ['█', '▒', '·'];

impl FlashTileMap {
    /// One line: the sizes and the counts of each class.
    pub fn summary(&self) -> String {
        let [skip, full, partial] = self.grid.counts();
        let (m, n) = self.grid.size;
        let (tm, tn) = self.grid.tile;
        format!(
            "{m}x{n} scores in {tm}x{tn} tiles ({}x{}): {full} full, {partial} partial (mask tested), {skip} skipped; {} of the scores skipped",
            self.grid.rows,
            self.grid.cols,
            percent(self.grid.skipped_share())
        )
    }

    /// The class a block of tiles shows as when the map is downsampled: the class when every
    /// tile has it, partial for a mix.
    fn block_class(&self, rows: std::ops::Range<usize>, cols: std::ops::Range<usize>) -> TileClass {
        let mut first = None;
        for r in rows {
            for c in cols.clone() {
                let class = self.grid.get(r, c);
                match first {
                    None => first = Some(class),
                    Some(f) if f != class => return TileClass::Partial,
                    Some(_) => {}
                }
            }
        }
        first.unwrap_or(TileClass::Skip)
    }
}

impl fmt::Display for FlashTileMap {
    /// A heading, the summary, and (for a masked op) the map: one character per tile, query
    /// blocks down and key blocks across, at most [`MAX_TEXT_SIDE`] a side.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.mask {
            Some(mask) => writeln!(f, "  tiles of the optimised IR's %{} (score {}, mask {}):", self.value, self.score, mask)?,
            None => writeln!(f, "  tiles of the optimised IR's %{} (score {}, no mask):", self.value, self.score)?,
        }
        writeln!(f, "    {}{}", self.summary(), if self.from_data { " (classified from the input data)" } else { "" })?;
        if self.mask.is_none() || self.grid.rows == 0 || self.grid.cols == 0 {
            return Ok(());
        }
        let step = self.grid.rows.max(self.grid.cols).div_ceil(MAX_TEXT_SIDE).max(1);
        let (rows, cols) = (self.grid.rows.div_ceil(step), self.grid.cols.div_ceil(step));
        let [full, partial, skip] = GLYPHS;
        if step > 1 {
            writeln!(f, "    {full} full  {partial} partial or mixed  {skip} skipped; one character per {step}x{step} tiles")?;
        } else {
            writeln!(f, "    {full} full  {partial} partial  {skip} skipped; one character per tile, keys across")?;
        }
        for r in 0..rows {
            f.write_str("    ")?;
            for c in 0..cols {
                let rr = r * step..((r + 1) * step).min(self.grid.rows);
                let cc = c * step..((c + 1) * step).min(self.grid.cols);
                let glyph = match self.block_class(rr, cc) {
                    TileClass::Full => full,
                    TileClass::Partial => partial,
                    TileClass::Skip => skip,
                };
                f.write_char(glyph)?;
            }
            f.write_char('\n')?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::percent;

    #[test]
    fn percentages_round_to_0_or_100_only_when_exact() {
        assert_eq!(percent(0.0), "0%");
        assert_eq!(percent(1.0), "100%");
        assert_eq!(percent(0.5), "50%");
        assert_eq!(percent(0.998), "99.8%");
        assert_eq!(percent(0.9999), "99.99%");
        assert_eq!(percent(0.0001), "0.01%");
    }
}
