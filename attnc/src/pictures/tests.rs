//! The pictures, decoded: sizes, and the colours of known cells.

use super::PictureError;
use super::heatmap::{Labels, NAN, heatmap_png};
use super::raster::{INK, Rect, viridis};
use super::tile_map::{FULL, PARTIAL, SKIP, tile_map_png};
use attn_compiler::Compiler;
use attn_compiler::ir::FlashTileMap;
use attn_runtime::Tensor;
use std::collections::HashMap;

/// Decodes a PNG into (width, height, RGB bytes).
fn decode(png: &[u8]) -> (usize, usize, Vec<u8>) {
    let decoder = png::Decoder::new(std::io::Cursor::new(png));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    assert_eq!(info.color_type, png::ColorType::Rgb);
    buf.truncate(info.buffer_size());
    (info.width as usize, info.height as usize, buf)
}

fn pixel(img: &(usize, usize, Vec<u8>), (x, y): (usize, usize)) -> [u8; 3] {
    let k = (y * img.0 + x) * 3;
    [img.2[k], img.2[k + 1], img.2[k + 2]]
}

/// The tile maps of an example at `dims` in 64×64 tiles.
fn maps(example: &str, dims: &[(&str, i64)]) -> Vec<FlashTileMap> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples").join(example);
    let source = std::fs::read_to_string(path).unwrap();
    let compiler = Compiler::default();
    let checked = compiler.check(&source).unwrap();
    let dims: HashMap<String, i64> = dims.iter().map(|(n, v)| (n.to_string(), *v)).collect();
    let explained = compiler.explain_at(&checked, None, &dims, (64, 64)).unwrap();
    explained.into_iter().flat_map(|e| e.tile_maps).collect()
}

/// The centre of tile (`r`, `c`) of a grid drawn at `grid` with `cell`-pixel tiles.
fn tile_centre((grid, cell): (Rect, usize), r: usize, c: usize) -> (usize, usize) {
    (grid.x + c * cell + cell / 2 - 1, grid.y + r * cell + cell / 2 - 1)
}

#[test]
fn causal_map_skips_the_top_right_and_runs_the_bottom_left_in_full() {
    let maps = maps("causal.attn", &[("S", 512)]);
    assert_eq!(maps.len(), 1);
    let map = &maps[0];
    assert_eq!((map.grid.rows, map.grid.cols), (8, 8));
    let picture = tile_map_png(&[("causal_attention", map)]).unwrap();
    let img = decode(&picture.png);
    let grid = picture.grids[0];
    assert_eq!(grid.0.w, 8 * grid.1);
    assert_eq!(pixel(&img, tile_centre(grid, 0, 7)), SKIP);
    assert_eq!(pixel(&img, tile_centre(grid, 7, 0)), FULL);
    assert_eq!(pixel(&img, tile_centre(grid, 3, 3)), PARTIAL);
    assert_eq!(pixel(&img, tile_centre(grid, 2, 5)), SKIP);
}

#[test]
fn sliding_window_map_shows_its_band_and_the_global_tokens() {
    // W = 4, G = 2: the band of |i - j| <= 4 touches the diagonal tiles and the corners of
    // their neighbours; the first row and column of tiles hold the global tokens. All of those
    // are partial, the rest skipped.
    let maps = maps("sliding_window.attn", &[("S", 256)]);
    let map = &maps[0];
    assert_eq!((map.grid.rows, map.grid.cols), (4, 4));
    let picture = tile_map_png(&[("sliding_window", map)]).unwrap();
    let img = decode(&picture.png);
    let grid = picture.grids[0];
    for r in 0..4usize {
        for c in 0..4usize {
            let expect = if r.abs_diff(c) <= 1 || r == 0 || c == 0 { PARTIAL } else { SKIP };
            assert_eq!(pixel(&img, tile_centre(grid, r, c)), expect, "tile ({r}, {c})");
        }
    }
}

#[test]
fn text_maps_downsample_large_grids() {
    let maps = maps("causal.attn", &[("S", 65536)]);
    let text = maps[0].to_string();
    assert!(text.contains("one character per 16x16 tiles"), "{text}");
    let rows: Vec<&str> = text.lines().filter(|l| l.starts_with("    ") && l.trim().chars().all(|c| "█▒·".contains(c))).collect();
    assert_eq!(rows.len(), 64, "{text}");
    assert!(rows.iter().all(|r| r.trim().chars().count() == 64));
    // Top-right skipped, bottom-left full, diagonal mixed.
    assert!(rows[0].ends_with('·') && rows[63].trim_start().starts_with('█') && rows[10].trim().chars().nth(10) == Some('▒'));
    assert!(text.contains("50% of the scores skipped"), "{text}");
}

/// A map of a few tiles is narrower than its title at twice the text size: the picture widens
/// so that the whole title is drawn, inside the margin.
#[test]
fn a_small_map_keeps_its_whole_title() {
    let maps = maps("causal.attn", &[("S", 128)]);
    let map = &maps[0];
    assert_eq!((map.grid.rows, map.grid.cols), (2, 2));
    // The title is set at scale 2 from (24, 24): its rightmost inked column.
    let (margin, glyph) = (24, 8);
    let title_end = |name: &str| {
        let img = decode(&tile_map_png(&[(name, map)]).unwrap().png);
        let inked = |x: usize| (margin..margin + 2 * glyph).any(|y| pixel(&img, (x, y)) == INK);
        ((0..img.0).rev().find(|&x| inked(x)).unwrap(), img.0)
    };
    // A title of 31 characters (496 pixels) is wider than the legend's 520-pixel picture allows.
    let suffix = format!(" %{}", map.value);
    let name: String = "causal_attention_over_all_heads".chars().take(31 - suffix.len()).collect();
    let (right, width) = title_end(&name);
    let end = margin + 2 * glyph * 31;
    assert!(right + 2 * glyph >= end && right < end, "title ends at {right}, expected near {end} (width {width})");
    assert!(width >= end + margin, "width {width} for a title ending at {end}");
    // A title longer than a full-size grid is cut with "...", still inside the margin.
    let (right, width) = title_end(&"long_".repeat(20));
    assert!(right < width - margin && width <= 2 * margin + 512 + 3 * glyph, "title ends at {right}, width {width}");
}

/// A heatmap of a few values keeps its whole title too.
#[test]
fn a_small_heatmap_keeps_its_whole_title() {
    let t = Tensor::f32(vec![2], vec![1.0, 2.0]).unwrap();
    let title = "attention_weights_of_layer_one f32[2]";
    let h = heatmap_png("attention_weights_of_layer_one", &t, None).unwrap();
    let img = decode(&h.png);
    let (margin, glyph) = (24, 8);
    let inked = |x: usize| (margin..margin + 2 * glyph).any(|y| pixel(&img, (x, y)) == INK);
    let right = (0..img.0).rev().find(|&x| inked(x)).unwrap();
    let end = margin + 2 * glyph * title.chars().count();
    assert!(right + 2 * glyph >= end && right < end, "title ends at {right}, expected near {end} (width {})", img.0);
    assert!(img.0 >= end + margin, "width {} for a title ending at {end}", img.0);
}

#[test]
fn an_empty_map_list_is_an_error() {
    assert!(matches!(tile_map_png(&[]), Err(PictureError::Shape(_))));
}

#[test]
fn heatmap_colours_follow_the_values_and_the_panels_follow_the_leading_axes() {
    // [2, 3, 4]: two panels; value = index, so the first cell is the minimum and the last the
    // maximum of the whole output.
    let data: Vec<f32> = (0..24).map(|v| v as f32).collect();
    let t = Tensor::f32(vec![2, 3, 4], data).unwrap();
    let h = heatmap_png("w", &t, None).unwrap();
    assert_eq!(h.panels.len(), 2);
    assert_eq!(h.range, (0.0, 23.0));
    let img = decode(&h.png);
    let cell = h.cell;
    let at = |p: usize, r: usize, c: usize| (h.panels[p].x + c * cell + cell / 2, h.panels[p].y + r * cell + cell / 2);
    assert_eq!(pixel(&img, at(0, 0, 0)), viridis(0.0));
    assert_eq!(pixel(&img, at(1, 2, 3)), viridis(1.0));
    assert_eq!(pixel(&img, at(1, 0, 0)), viridis(12.0 / 23.0));
    assert_eq!((img.0, img.1), (img.0.max(200), img.1.max(100)));
}

#[test]
fn heatmaps_mark_nan_and_accept_one_axis() {
    let t = Tensor::f32(vec![3], vec![1.0, f32::NAN, 2.0]).unwrap();
    let h = heatmap_png("v", &t, None).unwrap();
    let img = decode(&h.png);
    let p = h.panels[0];
    assert_eq!(pixel(&img, (p.x + h.cell + h.cell / 2, p.y + h.cell / 2)), NAN);
    assert_eq!(pixel(&img, (p.x + h.cell / 2, p.y + h.cell / 2)), viridis(0.0));
}

#[test]
fn heatmap_errors_are_typed() {
    let scalar = Tensor::f32(vec![], vec![1.0]).unwrap();
    assert!(matches!(heatmap_png("s", &scalar, None), Err(PictureError::Shape(_))));
    let empty = Tensor::f32(vec![0, 4], vec![]).unwrap();
    assert!(matches!(heatmap_png("e", &empty, None), Err(PictureError::Shape(_))));
    let t = Tensor::f32(vec![2, 2], vec![0.0; 4]).unwrap();
    let labels = Labels { rows: vec!["a".into()], cols: vec!["x".into(), "y".into()] };
    let err = heatmap_png("t", &t, Some(&labels)).unwrap_err();
    assert!(err.to_string().contains("1 row labels and 2 column labels for 2 rows and 2 columns"), "{err}");
    let big = Tensor::f32(vec![1, 2048], vec![0.0; 2048]).unwrap();
    let labels = Labels { rows: vec!["a".into()], cols: vec!["x".into(); 2048] };
    assert!(matches!(heatmap_png("big", &big, Some(&labels)), Err(PictureError::TooLarge { .. })));
}

#[test]
fn large_heatmaps_are_averaged_and_panels_capped() {
    let t = Tensor::f32(vec![20, 1, 2048], (0..20 * 2048).map(|v| (v % 2) as f32).collect()).unwrap();
    let h = heatmap_png("x", &t, None).unwrap();
    assert_eq!((h.factor, h.panels.len(), h.total_panels), (2, 16, 20));
    // Each cell averages a 0 and a 1.
    assert_eq!(h.range, (0.5, 0.5));
}

#[test]
fn labelled_heatmaps_draw_their_tokens() {
    let t = Tensor::f32(vec![2, 3], vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]).unwrap();
    let labels = Labels { rows: vec!["le".into(), "chat".into()], cols: vec!["the".into(), "cat".into(), "sat".into()] };
    let h = heatmap_png("w", &t, Some(&labels)).unwrap();
    let img = decode(&h.png);
    let p = h.panels[0];
    assert!(h.cell >= 10);
    // Ink left of the first row (its label) and above the first column.
    let ink = |x0: usize, x1: usize, y0: usize, y1: usize| (x0..x1).any(|x| (y0..y1).any(|y| pixel(&img, (x, y))[0] < 100));
    assert!(ink(p.x - 40, p.x - 2, p.y, p.y + h.cell));
    assert!(ink(p.x, p.x + h.cell, p.y - 30, p.y - 2));
}
