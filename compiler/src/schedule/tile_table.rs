//! The tile table of a flash op, one format for every backend: per (query block, key tile), the
//! tile's class by [`crate::ir::classify_tile`] (0 skip, 1 full, 2 partial), then for a partial
//! tile two bytes per chunk of [`CHUNK_ROWS`] rows: the span `[lo, hi)` of the tile's keys the
//! chunk's rows can keep, in units of [`CHUNK_COLS`] keys (every key outside it is masked for
//! those rows). Kernels that do not use the spans read the class byte of each entry.

use crate::ir::{Known, ScoreExpr, TileClass, classify_tile_in};

/// Rows per chunk of a partially masked tile.
pub const CHUNK_ROWS: usize = 32;
/// The unit of a chunk's key span.
pub const CHUNK_COLS: i64 = 16;

/// Bytes per entry for query blocks of `bm` rows.
pub fn entry_bytes(bm: usize) -> usize {
    1 + 2 * bm.div_ceil(CHUNK_ROWS)
}

/// The keys of the tile `cols` the query rows `rows` can keep, as `[lo, hi)` in units of
/// [`CHUNK_COLS`] from `cols.0`: every key before `lo` and from `hi` on is masked for these
/// rows. Binary searches: a masked prefix or suffix stays masked as it shrinks.
fn key_span(mask: Option<&ScoreExpr>, batch: &[(i64, i64)], rows: (i64, i64), cols: (i64, i64), known: &Known) -> (u8, u8) {
    let units = (cols.1 - cols.0 + CHUNK_COLS - 1) / CHUNK_COLS;
    let at = |u: i64| (cols.0 + u * CHUNK_COLS).min(cols.1);
    let skip = |range: (i64, i64)| classify_tile_in(mask, batch, rows, range, known) == TileClass::Skip;
    // Smallest `hi` with `[at(hi), end)` masked.
    let (mut lo, mut hi) = (0, units);
    while lo < hi {
        let mid = (lo + hi) / 2;
        if skip((at(mid), cols.1)) { hi = mid } else { lo = mid + 1 }
    }
    let end = lo;
    // Largest `lo ≤ end` with `[start, at(lo))` masked.
    let (mut lo, mut hi) = (0, end);
    while lo < hi {
        let mid = (lo + hi + 1) / 2;
        if skip((cols.0, at(mid))) { lo = mid } else { hi = mid - 1 }
    }
    let byte = |u: i64| u8::try_from(u).unwrap_or(u8::MAX);
    (byte(lo), byte(end))
}

/// The table of a mask over `m × n` scores (the batch indices in `batch`, an inclusive range per
/// batch axis, at once) in blocks of `bm × bn`, with chunk spans when `spans`, knowing what the
/// run gave (`known`: dims, scalar operands, and the range tables of data operands).
pub fn table(
    mask: Option<&ScoreExpr>,
    batch: &[(i64, i64)],
    (m, n): (i64, i64),
    (bm, bn): (i64, i64),
    spans: bool,
    known: &Known,
) -> Vec<u8> {
    let (bm, bn) = (bm.max(1), bn.max(1));
    let (nqb, nkb) = ((m + bm - 1) / bm, (n + bn - 1) / bn);
    let entry = entry_bytes(bm as usize);
    let mut out = Vec::with_capacity((nqb.max(0) * nkb.max(0)) as usize * entry);
    for qb in 0..nqb {
        for kb in 0..nkb {
            let rows = (qb * bm, ((qb + 1) * bm).min(m));
            let cols = (kb * bn, ((kb + 1) * bn).min(n));
            let class = classify_tile_in(mask, batch, rows, cols, known);
            let mut bytes = vec![0u8; entry];
            bytes[0] = match class {
                TileClass::Skip => 0,
                TileClass::Full => 1,
                TileClass::Partial => 2,
            };
            if class == TileClass::Partial && spans {
                for (c, b) in bytes[1..].chunks_exact_mut(2).enumerate() {
                    let r0 = rows.0 + (c * CHUNK_ROWS) as i64;
                    let chunk = (r0.min(rows.1), (r0 + CHUNK_ROWS as i64).min(rows.1));
                    (b[0], b[1]) = key_span(mask, batch, chunk, cols, known);
                }
            }
            out.extend(bytes);
        }
    }
    out
}
