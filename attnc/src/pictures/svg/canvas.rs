//! The SVG writer: layout-rs's render backend. It draws boxes, their text, edge curves and edge
//! labels as it is told, then [`Canvas::finish`] wraps them in a document with a title and a
//! legend, moved so that everything is in view. Numbers are written with one decimal at most and
//! every text is escaped, so the output is small, valid XML, and the same for the same input.

use layout::core::color::Color;
use layout::core::format::{ClipHandle, RenderBackend};
use layout::core::geometry::Point;
use layout::core::style::StyleAttr;
use std::fmt::Write;

/// The layout unit of edge labels: text drawn with it is an edge label (drawn last, on a white
/// ground over the edge), any other text is a box's.
pub(super) const EDGE_UNIT: usize = 6;
/// Margin around the drawing and height of the title band, in pixels.
const MARGIN: f64 = 16.0;
const TITLE_BAND: f64 = 52.0;
/// Width of one legend entry, in pixels.
const LEGEND_STEP: f64 = 150.0;

/// Pixel font size of text laid out with `unit` pixels per character: `layout-rs` measures text
/// as `font_size` pixels per character, a monospace advance (0.6 em) at `font_size * 5 / 3`
/// pixels, so text drawn at that size fits the room the layout made for it.
pub(super) fn font_px(unit: usize) -> f64 {
    unit as f64 * 5.0 / 3.0
}

/// Baseline-to-baseline distance of text laid out with `unit`.
pub(super) fn line_height(unit: usize) -> f64 {
    font_px(unit) * 1.2
}

/// A number as SVG writes it: at most one decimal, no `-0`.
fn num(x: f64) -> String {
    let r = (x * 10.0).round() / 10.0;
    let r = if r == 0.0 || !r.is_finite() { 0.0 } else { r };
    if r.fract() == 0.0 { format!("{r:.0}") } else { format!("{r:.1}") }
}

/// Escapes text for XML content and attribute values; control characters XML cannot carry
/// become U+FFFD.
pub(super) fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            '\t' | '\n' | '\r' => out.push(c),
            c if (c as u32) < 0x20 || c == '\u{fffe}' || c == '\u{ffff}' => out.push('\u{fffd}'),
            c => out.push(c),
        }
    }
    out
}

fn web(c: Option<Color>) -> String {
    let hex = c.map_or_else(String::new, |c| c.to_web_color());
    // `#rrggbbaa`: opaque colours as `#rrggbb`, transparent as none.
    match hex.get(7..9) {
        Some("ff") => hex[..7].to_string(),
        Some(_) | None => "none".to_string(),
    }
}

/// An edge label: centre and half width in pixels, and text.
#[derive(Debug)]
struct Label {
    x: f64,
    y: f64,
    half: f64,
    text: String,
}

/// The render backend: collects SVG elements (edges drawn under boxes) and their extent.
#[derive(Debug, Default)]
pub(super) struct Canvas {
    edges: String,
    boxes: String,
    labels: Vec<Label>,
    /// min x, min y, max x, max y of everything drawn.
    extent: Option<(f64, f64, f64, f64)>,
}

impl Canvas {
    fn grow(&mut self, a: Point, b: Point) {
        let (x0, y0, x1, y1) = (a.x.min(b.x), a.y.min(b.y), a.x.max(b.x), a.y.max(b.y));
        if !(x0.is_finite() && y0.is_finite() && x1.is_finite() && y1.is_finite()) {
            return;
        }
        self.extent = Some(match self.extent {
            None => (x0, y0, x1, y1),
            Some((a0, b0, a1, b1)) => (a0.min(x0), b0.min(y0), a1.max(x1), b1.max(y1)),
        });
    }

    /// The whole document: title, `legend` (text, fill and stroke of each kind of box), then the
    /// drawing moved below them, edge labels last (over the edges, each on a white ground).
    pub(super) fn finish(&self, title: &str, legend: &[(&str, u32, u32)]) -> String {
        let mut labels = String::new();
        for Label { x, y, half, text } in &self.labels {
            let _ = writeln!(
                labels,
                "<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"14\" fill=\"#ffffff\"/><text class=\"edge\" x=\"{}\" y=\"{}\" font-size=\"{}\" text-anchor=\"middle\" dominant-baseline=\"central\" fill=\"#444444\">{}</text>",
                num(x - half - 2.0),
                num(y - 7.0),
                num(2.0 * half + 4.0),
                num(*x),
                num(*y),
                num(font_px(EDGE_UNIT)),
                escape(text)
            );
        }
        let (x0, y0, x1, y1) = self.extent.unwrap_or((0.0, 0.0, 0.0, 0.0));
        let legend_width = legend.len() as f64 * LEGEND_STEP;
        let width = (x1 - x0 + 2.0 * MARGIN).max(legend_width + 2.0 * MARGIN).ceil();
        let height = (y1 - y0 + 2.0 * MARGIN + TITLE_BAND).ceil();
        let mut s = String::new();
        s.push_str("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
        let (w, h) = (num(width), num(height));
        let _ = writeln!(s, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\">");
        let _ = writeln!(s, "<title>{}</title>", escape(title));
        s.push_str("<defs><marker id=\"head\" markerWidth=\"8\" markerHeight=\"6\" refX=\"8\" refY=\"3\" orient=\"auto\">");
        s.push_str("<polygon points=\"0 0, 8 3, 0 6\" fill=\"#666666\"/></marker></defs>\n");
        s.push_str("<style>text { font-family: ui-monospace, 'DejaVu Sans Mono', Menlo, Consolas, monospace; }</style>\n");
        let _ = writeln!(s, "<rect width=\"100%\" height=\"100%\" fill=\"#ffffff\"/>");
        let _ = writeln!(
            s,
            "<text class=\"title\" x=\"{}\" y=\"{}\" font-size=\"16\" font-weight=\"bold\">{}</text>",
            num(MARGIN),
            num(MARGIN + 8.0),
            escape(title)
        );
        for (k, (text, fill, stroke)) in legend.iter().enumerate() {
            let x = MARGIN + k as f64 * LEGEND_STEP;
            let y = MARGIN + 22.0;
            let _ = writeln!(
                s,
                "<rect class=\"legend\" x=\"{}\" y=\"{}\" width=\"14\" height=\"12\" rx=\"2\" fill=\"#{fill:06x}\" stroke=\"#{stroke:06x}\"/><text x=\"{}\" y=\"{}\" font-size=\"11\" dominant-baseline=\"central\">{}</text>",
                num(x),
                num(y),
                num(x + 20.0),
                num(y + 6.0),
                escape(text)
            );
        }
        let _ = writeln!(s, "<g transform=\"translate({} {})\">", num(MARGIN - x0), num(MARGIN + TITLE_BAND - y0));
        s.push_str(&self.edges);
        s.push_str(&self.boxes);
        s.push_str(&labels);
        s.push_str("</g>\n</svg>\n");
        s
    }
}

impl RenderBackend for Canvas {
    fn draw_rect(&mut self, xy: Point, size: Point, look: &StyleAttr, properties: Option<String>, _clip: Option<ClipHandle>) {
        self.grow(xy, xy.add(size));
        let class = properties.map(|p| format!(" class=\"{}\"", escape(&p))).unwrap_or_default();
        let _ = writeln!(
            self.boxes,
            "<rect{class} x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" rx=\"{}\" fill=\"{}\" stroke=\"{}\" stroke-width=\"{}\"/>",
            num(xy.x),
            num(xy.y),
            num(size.x),
            num(size.y),
            look.rounded,
            web(look.fill_color),
            web(Some(look.line_color)),
            look.line_width
        );
    }

    fn draw_line(&mut self, start: Point, stop: Point, look: &StyleAttr, _properties: Option<String>) {
        self.grow(start, stop);
        let _ = writeln!(
            self.edges,
            "<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"{}\" stroke-width=\"{}\"/>",
            num(start.x),
            num(start.y),
            num(stop.x),
            num(stop.y),
            web(Some(look.line_color)),
            look.line_width
        );
    }

    fn draw_circle(&mut self, xy: Point, size: Point, look: &StyleAttr, _properties: Option<String>) {
        self.grow(xy.sub(size.scale(0.5)), xy.add(size.scale(0.5)));
        let _ = writeln!(
            self.boxes,
            "<ellipse cx=\"{}\" cy=\"{}\" rx=\"{}\" ry=\"{}\" fill=\"{}\" stroke=\"{}\"/>",
            num(xy.x),
            num(xy.y),
            num(size.x / 2.0),
            num(size.y / 2.0),
            web(look.fill_color),
            web(Some(look.line_color))
        );
    }

    /// Box text: lines of monospace text left-aligned in the box. Edge labels (told apart by
    /// their layout unit) are kept for [`Canvas::finish`], which draws them over the edges.
    fn draw_text(&mut self, xy: Point, text: &str, look: &StyleAttr) {
        let lines: Vec<&str> = text.lines().collect();
        let unit = look.font_size;
        let chars = lines.iter().map(|l| l.chars().count()).max().unwrap_or(0) as f64;
        let half = chars * unit as f64 / 2.0;
        let step = line_height(unit);
        let top = xy.y - (lines.len() as f64 - 1.0) * step / 2.0;
        self.grow(Point::new(xy.x - half, top - step / 2.0), Point::new(xy.x + half, top + lines.len() as f64 * step));
        if unit == EDGE_UNIT {
            self.labels.push(Label { x: xy.x, y: xy.y, half, text: text.to_string() });
            return;
        }
        let _ = write!(self.boxes, "<text class=\"label\" font-size=\"{}\" dominant-baseline=\"central\">", num(font_px(unit)));
        for (k, line) in lines.iter().enumerate() {
            let _ = write!(self.boxes, "<tspan x=\"{}\" y=\"{}\">{}</tspan>", num(xy.x - half), num(top + k as f64 * step), escape(line));
        }
        self.boxes.push_str("</text>\n");
    }

    fn draw_arrow(
        &mut self,
        path: &[(Point, Point)],
        dashed: bool,
        head: (bool, bool),
        look: &StyleAttr,
        _properties: Option<String>,
        text: &str,
    ) {
        let (Some(first), Some(second)) = (path.first(), path.get(1)) else { return };
        for (a, b) in path {
            self.grow(*a, *b);
        }
        let mut d = format!(
            "M {} {} C {} {}, {} {}, {} {}",
            num(first.0.x),
            num(first.0.y),
            num(first.1.x),
            num(first.1.y),
            num(second.0.x),
            num(second.0.y),
            num(second.1.x),
            num(second.1.y)
        );
        for (a, b) in &path[2..] {
            let _ = write!(d, " S {} {}, {} {}", num(a.x), num(a.y), num(b.x), num(b.y));
        }
        let dash = if dashed { " stroke-dasharray=\"5,5\"" } else { "" };
        let start = if head.0 { " marker-start=\"url(#head)\"" } else { "" };
        let end = if head.1 { " marker-end=\"url(#head)\"" } else { "" };
        let _ = writeln!(
            self.edges,
            "<path class=\"edge\" d=\"{d}\" fill=\"none\" stroke=\"{}\" stroke-width=\"{}\"{dash}{start}{end}/>",
            web(Some(look.line_color)),
            look.line_width
        );
        // layout-rs moves edge labels onto label boxes of their own; only self-edges keep text.
        if !text.is_empty() {
            self.draw_text(second.1, text, look);
        }
    }

    fn create_clip(&mut self, _xy: Point, _size: Point, _rounded_px: usize) -> ClipHandle {
        // Only records (which this module never draws) clip.
        0
    }
}
