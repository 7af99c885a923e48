//! Heatmaps of outputs: the last two axes of a tensor as rows and columns of cells coloured by
//! viridis (perceptually uniform), one panel per index of the leading axes, a shared colour bar,
//! and optional row and column labels (tokens, as in the alignment figures of Bahdanau et al.).

use super::raster::{Canvas, GLYPH, GREY, INK, Rect, Rgb, WHITE, text_width, viridis};
use super::{PictureError, Result};
use attn_runtime::Tensor;

/// The most panels drawn; an output with more leading indices shows the first ones and says so.
pub const MAX_PANELS: usize = 16;
/// The most cells a panel shows a side; larger outputs are averaged down by a whole factor.
pub const MAX_CELLS: usize = 1024;
/// The colour of a NaN cell.
pub const NAN: Rgb = [128, 128, 128];
/// Longest label drawn, in characters (longer ones are cut).
const MAX_LABEL: usize = 24;
const MARGIN: usize = 24;
const BAR_W: usize = 16;

/// A drawn heatmap: the PNG and its geometry, for tests and tools.
#[derive(Clone, Debug)]
pub struct HeatmapPicture {
    /// The PNG file.
    pub png: Vec<u8>,
    /// Each panel's cell area.
    pub panels: Vec<Rect>,
    /// The side of one cell in pixels.
    pub cell: usize,
    /// How many rows and columns of the output one cell averages.
    pub factor: usize,
    /// The value range the colours span (finite values only).
    pub range: (f64, f64),
    /// Panels the output has (more than drawn when over [`MAX_PANELS`]).
    pub total_panels: usize,
}

/// Row and column labels.
#[derive(Clone, Debug, Default)]
pub struct Labels {
    /// One per row (the second-to-last axis).
    pub rows: Vec<String>,
    /// One per column (the last axis).
    pub cols: Vec<String>,
}

/// Draws `tensor` (named `name`) as a heatmap. A rank-1 tensor is one row; a scalar is an
/// error, as are labels whose counts differ from the rows and columns.
pub fn heatmap_png(name: &str, tensor: &Tensor, labels: Option<&Labels>) -> Result<HeatmapPicture> {
    let shape = &tensor.shape;
    let (m, n, lead) = match shape.len() {
        0 => return Err(PictureError::Shape(format!("`{name}` is a scalar: a heatmap needs at least one axis"))),
        1 => (1, shape[0], 1),
        r => (shape[r - 2], shape[r - 1], shape[..r - 2].iter().product::<usize>()),
    };
    if m == 0 || n == 0 || lead == 0 {
        return Err(PictureError::Shape(format!("`{name}` is empty (shape {shape:?}): there is nothing to draw")));
    }
    if let Some(l) = labels.filter(|l| l.rows.len() != m || l.cols.len() != n) {
        return Err(PictureError::Shape(format!(
            "the labels do not fit `{name}`: {} row labels and {} column labels for {m} rows and {n} columns",
            l.rows.len(),
            l.cols.len()
        )));
    }
    let factor = m.max(n).div_ceil(MAX_CELLS);
    if factor > 1 && labels.is_some() {
        return Err(PictureError::TooLarge {
            what: format!("a labelled heatmap of `{name}`"),
            detail: format!("{m}x{n} cells; labels need one cell per row and column, at most {MAX_CELLS} a side"),
        });
    }
    let (rows, cols) = (m.div_ceil(factor), n.div_ceil(factor));
    let shown = lead.min(MAX_PANELS);
    let panels_data = cell_averages(&tensor.to_f64_vec(), shown, (m, n), factor, (rows, cols));
    let finite = panels_data.iter().flatten().copied().filter(|v| v.is_finite());
    let (lo, hi) = finite.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| (lo.min(v), hi.max(v)));
    let range = if lo <= hi { (lo, hi) } else { (0.0, 0.0) };
    let any_nan = panels_data.iter().flatten().any(|v| v.is_nan());

    let mut notes = Vec::new();
    if factor > 1 {
        notes.push(format!("each cell averages {factor}x{factor} values"));
    }
    if shown < lead {
        notes.push(format!("the first {shown} of {lead} panels"));
    }
    if any_nan {
        notes.push("grey: NaN".to_string());
    }
    // Geometry.
    let min_cell = if labels.is_some() { 10 } else { 1 };
    let cell = (384 / rows.max(cols)).clamp(min_cell, 32);
    let (row_label_w, col_label_h) = match labels {
        Some(l) => (
            l.rows.iter().map(|s| s.chars().count().min(MAX_LABEL)).max().unwrap_or(0) * GLYPH + 6,
            l.cols.iter().map(|s| s.chars().count().min(MAX_LABEL)).max().unwrap_or(0) * GLYPH + 6,
        ),
        None => (0, 0),
    };
    let grid_cols = (shown as f64).sqrt().ceil() as usize;
    let grid_rows = shown.div_ceil(grid_cols.max(1));
    let title_h = 2 * GLYPH + 8;
    let panel_title_h = if lead > 1 { GLYPH + 6 } else { 0 };
    let panel_w = row_label_w + cols * cell;
    let panel_h = panel_title_h + col_label_h + rows * cell;
    let ticks_w = [range.0, (range.0 + range.1) / 2.0, range.1].iter().map(|v| text_width(&tick(*v), 1)).max().unwrap_or(0);
    let grid_w = grid_cols * (panel_w + MARGIN);
    let notes_h = if notes.is_empty() { 0 } else { GLYPH + 8 };
    let dims: Vec<String> = shape.iter().map(usize::to_string).collect();
    let title = format!("{name} {}[{}]", tensor.dtype, dims.join(", "));
    let notes = notes.join("; ");
    // Wide enough for the title (twice the text size) and the notes, however small the grid.
    let width = (MARGIN + grid_w + BAR_W + 8 + ticks_w + MARGIN).max(2 * MARGIN + text_width(&title, 2).max(text_width(&notes, 1)));
    let bar_h = (rows * cell).max(128);
    let grid_h = (grid_rows * (panel_h + MARGIN)).max(panel_title_h + col_label_h + bar_h + MARGIN);
    let height = MARGIN + title_h + grid_h + notes_h + MARGIN;
    let mut canvas = Canvas::new(width, height, WHITE, &format!("the heatmap of `{name}`"))?;

    canvas.text(MARGIN, MARGIN, &title, 2, INK);
    let top = MARGIN + title_h;
    let mut rects = Vec::with_capacity(shown);
    for (p, cells) in panels_data.iter().enumerate() {
        let (gr, gc) = (p / grid_cols.max(1), p % grid_cols.max(1));
        let px = MARGIN + gc * (panel_w + MARGIN);
        let py = top + gr * (panel_h + MARGIN);
        if lead > 1 {
            canvas.text(px + row_label_w, py, &format!("[{}]", lead_index(&shape[..shape.len() - 2], p).join(", ")), 1, INK);
        }
        let area = Rect { x: px + row_label_w, y: py + panel_title_h + col_label_h, w: cols * cell, h: rows * cell };
        draw_cells(&mut canvas, area, cells, cols, cell, range);
        if let Some(l) = labels {
            draw_labels(&mut canvas, area, l, cell);
        }
        rects.push(area);
    }

    // The colour bar, as tall as one panel's cells (at least 128 pixels), beside the grid.
    draw_colour_bar(&mut canvas, Rect { x: MARGIN + grid_w, y: top + panel_title_h + col_label_h, w: BAR_W, h: bar_h }, range);

    if !notes.is_empty() {
        canvas.text(MARGIN, height - MARGIN - notes_h, &notes, 1, INK);
    }
    Ok(HeatmapPicture { png: canvas.to_png()?, panels: rects, cell, factor, range, total_panels: lead })
}

/// The average of each `factor × factor` block of cells of the first `shown` `m × n` panels of
/// `values`, row-major (NaN stays NaN, infinities clamp to the range when drawn).
fn cell_averages(values: &[f64], shown: usize, (m, n): (usize, usize), factor: usize, (rows, cols): (usize, usize)) -> Vec<Vec<f64>> {
    let mut panels = Vec::with_capacity(shown);
    for p in 0..shown {
        let base = p * m * n;
        let mut cells = vec![0.0f64; rows * cols];
        for (k, cell) in cells.iter_mut().enumerate() {
            let (r, c) = (k / cols, k % cols);
            let (mut sum, mut count) = (0.0, 0usize);
            for rr in r * factor..((r + 1) * factor).min(m) {
                for cc in c * factor..((c + 1) * factor).min(n) {
                    sum += values.get(base + rr * n + cc).copied().unwrap_or(f64::NAN);
                    count += 1;
                }
            }
            *cell = sum / count.max(1) as f64;
        }
        panels.push(cells);
    }
    panels
}

/// One panel's cells, coloured by where each falls in `range`, framed.
fn draw_cells(canvas: &mut Canvas, area: Rect, cells: &[f64], cols: usize, cell: usize, range: (f64, f64)) {
    for (k, v) in cells.iter().enumerate() {
        let (r, c) = (k / cols, k % cols);
        let colour = if v.is_nan() { NAN } else { viridis(scaled(*v, range)) };
        canvas.fill(Rect { x: area.x + c * cell, y: area.y + r * cell, w: cell, h: cell }, colour);
    }
    canvas.frame(area, GREY);
}

/// Row labels left of a panel and column labels (upwards) above it.
fn draw_labels(canvas: &mut Canvas, area: Rect, l: &Labels, cell: usize) {
    let cut = |s: &str| s.chars().take(MAX_LABEL).collect::<String>();
    for (r, label) in l.rows.iter().enumerate() {
        let label = cut(label);
        let x = area.x.saturating_sub(text_width(&label, 1) + 4);
        canvas.text(x, area.y + r * cell + (cell - GLYPH) / 2, &label, 1, INK);
    }
    for (c, label) in l.cols.iter().enumerate() {
        canvas.text_up(area.x + c * cell + (cell - GLYPH) / 2, area.y.saturating_sub(4), &cut(label), 1, INK);
    }
}

/// The colour bar in `bar`, with the range's ends and middle as ticks beside it.
fn draw_colour_bar(canvas: &mut Canvas, bar: Rect, range: (f64, f64)) {
    for y in 0..bar.h {
        let t = 1.0 - y as f64 / (bar.h - 1).max(1) as f64;
        canvas.fill(Rect { x: bar.x, y: bar.y + y, w: bar.w, h: 1 }, viridis(t));
    }
    canvas.frame(bar, GREY);
    let tx = bar.x + bar.w + 6;
    canvas.text(tx, bar.y, &tick(range.1), 1, INK);
    canvas.text(tx, bar.y + bar.h / 2 - GLYPH / 2, &tick((range.0 + range.1) / 2.0), 1, INK);
    canvas.text(tx, bar.y + bar.h - GLYPH, &tick(range.0), 1, INK);
}

/// Where `v` falls in `range`, in `[0, 1]`; a flat range is the middle.
fn scaled(v: f64, (lo, hi): (f64, f64)) -> f64 {
    if hi > lo { ((v - lo) / (hi - lo)).clamp(0.0, 1.0) } else { 0.5 }
}

/// A tick label: 4 significant digits, exponent form for very large or small values.
fn tick(v: f64) -> String {
    let a = v.abs();
    if a != 0.0 && !(1e-3..1e5).contains(&a) { format!("{v:.3e}") } else { format!("{v:.4}") }
}

/// The leading-axes index of panel `p` (row-major).
fn lead_index(lead: &[usize], mut p: usize) -> Vec<String> {
    let mut idx = vec![String::new(); lead.len()];
    for (k, &d) in lead.iter().enumerate().rev() {
        idx[k] = (p % d.max(1)).to_string();
        p /= d.max(1);
    }
    idx
}
