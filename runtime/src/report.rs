//! Human-facing text: rendered diagnostics and one-line tensor summaries.
//!
//! Libraries return [`Diagnostic`]s as plain data; this is the one place that turns them into the
//! boxed, labelled snippets users see (through miette's graphical handler).

use attn_compiler::tensor::Tensor;
use attn_dsl::{Diagnostic, Label, Severity, Span};
use miette::{GraphicalReportHandler, GraphicalTheme, LabeledSpan, NamedSource, SourceSpan};
use std::fmt;

/// Width used when rendering; fixed so that output does not depend on the terminal.
const WIDTH: usize = 100;

/// Renders diagnostics for a terminal: for each one, `× error[CODE]: message`, a
/// `╭─[file:line:col]` snippet with the primary and secondary labels underlined, and the help.
///
/// With `color = false` the output contains no escape codes and is stable (what snapshot tests
/// hold). Diagnostics are separated by a blank line.
pub fn render_diagnostics(diags: &[Diagnostic], file_name: &str, source: &str, color: bool) -> String {
    let theme = if color { GraphicalTheme::unicode() } else { GraphicalTheme::unicode_nocolor() };
    let handler = GraphicalReportHandler::new_themed(theme).with_width(WIDTH).with_links(false).with_context_lines(1);
    let mut out = String::new();
    for d in diags {
        let report = Report::new(d, file_name, source);
        let mut text = String::new();
        if handler.render_report(&mut text, &report).is_err() {
            // miette only fails on spans it cannot read; the plain renderer always works.
            text = d.render_plain(file_name, source);
        }
        if !out.is_empty() {
            out.push('\n');
        }
        out.push_str(text.trim_end());
        out.push('\n');
    }
    out
}

/// A [`Diagnostic`] adapted to miette's trait, with its source attached.
#[derive(Debug)]
struct Report {
    message: String,
    severity: Severity,
    help: Option<String>,
    labels: Vec<LabeledSpan>,
    source: NamedSource<String>,
}

impl Report {
    fn new(d: &Diagnostic, file_name: &str, source: &str) -> Report {
        let span = |label: &Label, primary: bool| {
            let mut start = clamp_to_char(source, label.span.start as usize);
            let mut end = clamp_to_char(source, label.span.end as usize).max(start);
            let mut text = (!label.message.is_empty()).then(|| label.message.clone());
            // miette draws nothing for an empty span at the end of the text ("found end of
            // file"); point at the last visible character instead, saying so.
            if start == end
                && source[start..].trim().is_empty()
                && let Some((i, c)) = source[..start].char_indices().rev().find(|(_, c)| !c.is_whitespace())
            {
                (start, end) = (i, i + c.len_utf8());
                text = Some("the file ends after this".to_string());
            }
            let span = SourceSpan::from(start..end);
            if primary { LabeledSpan::new_primary_with_span(text, span) } else { LabeledSpan::new_with_span(text, span) }
        };
        // miette cannot draw a label inside another on one line: it pushes the inner ones past
        // the end of the outer one. Operands are labelled inside the primary span (`q @ k`, a
        // call), so the primary is drawn under what is left of it: the operator or the name.
        let inner: Vec<(usize, usize)> = d
            .secondary
            .iter()
            .map(|l| (l.span.start as usize, l.span.end as usize))
            .filter(|&(s, e)| s < e && d.primary.span.start as usize <= s && e <= d.primary.span.end as usize)
            .filter(|&(s, e)| (s, e) != (d.primary.span.start as usize, d.primary.span.end as usize))
            .collect();
        let mut primary = d.primary.clone();
        if let Some((s, e)) = uncovered_token(source, (primary.span.start as usize, primary.span.end as usize), &inner) {
            primary.span = Span::new(s, e);
        }
        let mut labels = vec![span(&primary, true)];
        labels.extend(d.secondary.iter().map(|l| span(l, false)));
        let kind = match d.severity {
            Severity::Error => "error",
            Severity::Warning => "warning",
        };
        Report {
            // rustc's `error[CODE]: message`: miette would print a bare code on a line of its own.
            message: format!("{kind}[{}]: {}", d.code, d.message),
            severity: d.severity,
            help: d.help.clone(),
            labels,
            source: NamedSource::new(file_name, source.to_string()),
        }
    }
}

/// The first token of `outer` that no span of `inner` covers: an operator (`@`, `**`), a name
/// (`where` in `where(c, a, b)`, `softmax` in `x.softmax()`), else the first other character.
/// `None` when `inner` is empty or covers every visible character.
fn uncovered_token(source: &str, outer: (usize, usize), inner: &[(usize, usize)]) -> Option<(usize, usize)> {
    if inner.is_empty() || outer.1 > source.len() {
        return None;
    }
    let covered = |i: usize| inner.iter().any(|&(s, e)| s <= i && i < e);
    let free = |i: usize, c: char| !covered(i) && !c.is_whitespace() && !matches!(c, '(' | ')' | '[' | ']' | ',' | '.');
    let text = source.get(outer.0..outer.1)?;
    let mut chars = text.char_indices().map(|(i, c)| (outer.0 + i, c)).skip_while(|&(i, c)| !free(i, c)).peekable();
    let &(start, first) = chars.peek()?;
    let word = |c: char| c.is_alphanumeric() || c == '_';
    let same_kind = |c: char| if word(first) { word(c) } else { !word(c) };
    let end = chars.take_while(|&(i, c)| free(i, c) && same_kind(c)).last().map(|(i, c)| i + c.len_utf8())?;
    Some((start, end))
}

/// A byte offset moved into the source and back onto a character boundary, so that a stale or
/// corrupt span cannot make the renderer fail.
fn clamp_to_char(source: &str, offset: usize) -> usize {
    let mut i = offset.min(source.len());
    while i > 0 && !source.is_char_boundary(i) {
        i -= 1;
    }
    i
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Report {}

impl miette::Diagnostic for Report {
    fn severity(&self) -> Option<miette::Severity> {
        Some(match self.severity {
            Severity::Error => miette::Severity::Error,
            Severity::Warning => miette::Severity::Warning,
        })
    }

    fn help<'a>(&'a self) -> Option<Box<dyn fmt::Display + 'a>> {
        self.help.as_ref().map(|h| Box::new(h) as Box<dyn fmt::Display>)
    }

    fn source_code(&self) -> Option<&dyn miette::SourceCode> {
        Some(&self.source)
    }

    fn labels(&self) -> Option<Box<dyn Iterator<Item = LabeledSpan> + '_>> {
        Some(Box::new(self.labels.iter().cloned()))
    }
}

/// One line describing an output: `name: f32[2, 4, 16, 8] min=-1.234 max=2.345 mean=0.0123`.
///
/// Numbers have 4 significant digits. NaNs are left out of min/max/mean and counted (`nan=3`); an
/// empty tensor prints `(empty)`. For bool tensors the mean is the fraction of `true`.
pub fn summarize(name: &str, tensor: &Tensor) -> String {
    let dims: Vec<String> = tensor.shape.iter().map(|d| d.to_string()).collect();
    let head = format!("{name}: {}[{}]", tensor.dtype, dims.join(", "));
    let values = tensor.to_f64_vec();
    let nans = values.iter().filter(|v| v.is_nan()).count();
    let finite: Vec<f64> = values.into_iter().filter(|v| !v.is_nan()).collect();
    if finite.is_empty() {
        return if nans == 0 { format!("{head} (empty)") } else { format!("{head} nan={nans}") };
    }
    let min = finite.iter().copied().fold(f64::INFINITY, f64::min);
    let max = finite.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let mean = finite.iter().sum::<f64>() / finite.len() as f64;
    let mut line = format!("{head} min={} max={} mean={}", fmt_num(min), fmt_num(max), fmt_num(mean));
    if nans > 0 {
        line.push_str(&format!(" nan={nans}"));
    }
    line
}

/// 4 significant digits without trailing zeros; scientific notation outside `[1e-4, 1e6)`.
fn fmt_num(v: f64) -> String {
    if v.is_infinite() {
        return if v > 0.0 { "inf".into() } else { "-inf".into() };
    }
    if v == 0.0 {
        return "0".into();
    }
    let mag = v.abs();
    if !(1e-4..1e6).contains(&mag) {
        return format!("{v:.3e}");
    }
    let digits_before = mag.log10().floor() as i32 + 1;
    let decimals = (4 - digits_before).max(0) as usize;
    let s = format!("{v:.decimals$}");
    if s.contains('.') { s.trim_end_matches('0').trim_end_matches('.').to_string() } else { s }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn diag() -> Diagnostic {
        Diagnostic::error("E0201", "shapes do not match", Span::new(26, 31), "this is f32[B, S]")
            .with_label(Span::new(8, 9), "S declared here")
            .with_help("transpose one side")
    }

    #[test]
    fn renders_location_code_labels_and_help_without_colour() {
        let src = "fn f(x: f32[B, S]) -> f32[B] {\n  return x + y\n}\n";
        let d = Diagnostic::error("E0201", "shapes do not match", Span::new(40, 45), "this is f32[B, S]")
            .with_label(Span::new(5, 6), "x declared here")
            .with_help("transpose one side");
        let text = render_diagnostics(&[d], "demo.attn", src, false);
        assert!(text.contains("demo.attn:2:10"), "{text}");
        assert!(text.contains("error[E0201]: shapes do not match"), "{text}");
        assert!(text.contains("this is f32[B, S]"), "{text}");
        assert!(text.contains("x declared here"), "{text}");
        assert!(text.contains("help: transpose one side"), "{text}");
        assert!(!text.contains('\u{1b}'), "escape codes in no-colour output: {text:?}");
    }

    #[test]
    fn exact_plain_rendering() {
        let src = "fn f(x: f32[N]) -> f32[N] {\n  return x + y\n}\n";
        let d = Diagnostic::error("E0101", "unknown name `y`", Span::new(41, 42), "not defined").with_help("declare it first");
        let expected = "  × error[E0101]: unknown name `y`
   ╭─[bad.attn:2:14]
 1 │ fn f(x: f32[N]) -> f32[N] {
 2 │   return x + y
   ·              ┬
   ·              ╰── not defined
 3 │ }
   ╰────
  help: declare it first
";
        assert_eq!(render_diagnostics(&[d], "bad.attn", src, false), expected);
    }

    #[test]
    fn operand_labels_inside_the_primary_span_sit_under_their_operands() {
        let src = "let s = q @ k\n";
        let d = Diagnostic::error("E0102", "inner dimensions differ", Span::new(8, 13), "in this `@`")
            .with_label(Span::new(8, 9), "this is f32[S, D]")
            .with_label(Span::new(12, 13), "this is f32[T, D]");
        let expected = "  × error[E0102]: inner dimensions differ
   ╭─[a.attn:1:11]
 1 │ let s = q @ k
   ·         ┬ ┬ ┬
   ·         │ │ ╰── this is f32[T, D]
   ·         │ ╰── in this `@`
   ·         ╰── this is f32[S, D]
   ╰────
";
        assert_eq!(render_diagnostics(&[d], "a.attn", src, false), expected);
    }

    #[test]
    fn a_call_with_labelled_operands_is_marked_at_its_name() {
        assert_eq!(uncovered_token("where(c, a, -b)", (0, 15), &[(6, 7), (9, 10), (12, 14)]), Some((0, 5)));
        assert_eq!(uncovered_token("x.softmax()", (0, 11), &[(0, 1)]), Some((2, 9)));
        assert_eq!(uncovered_token("a ** b", (0, 6), &[(0, 1), (5, 6)]), Some((2, 4)));
        assert_eq!(uncovered_token("(a)", (0, 3), &[(1, 2)]), None);
        assert_eq!(uncovered_token("a + b", (0, 5), &[]), None);
    }

    #[test]
    fn colour_output_has_escape_codes() {
        let src = "fn f(x: f32[B, S]) -> f32[B] { return x }\n";
        let text = render_diagnostics(&[diag()], "a.attn", src, true);
        assert!(text.contains('\u{1b}'), "{text:?}");
    }

    #[test]
    fn spans_past_the_end_or_inside_a_char_do_not_fail() {
        let src = "fn é(x: f32) -> f32 { return x }";
        let d = Diagnostic::error("E0001", "bad", Span::new(4, 500), "here");
        let text = render_diagnostics(&[d], "a.attn", src, false);
        assert!(text.contains("bad"), "{text}");
    }

    #[test]
    fn an_empty_span_at_the_end_points_at_the_last_character() {
        let src = "fn f(x: f32) -> f32 {\n  return x +\n\n";
        let d = Diagnostic::error("E0002", "expected an expression", Span::new(src.len(), src.len()), "end of file here");
        let text = render_diagnostics(&[d], "a.attn", src, false);
        assert!(text.contains("a.attn:2:12"), "{text}");
        assert!(text.contains("the file ends after this"), "{text}");
    }

    #[test]
    fn several_diagnostics_are_separated() {
        let src = "fn f(x: f32[B, S]) -> f32[B] { return x }\n";
        let text = render_diagnostics(&[diag(), diag()], "a.attn", src, false);
        assert_eq!(text.matches("E0201").count(), 2, "{text}");
        assert!(text.contains("\n\n"), "{text}");
    }

    #[test]
    fn summary_line() {
        let t = Tensor::f32(vec![2, 2], vec![-1.2344, 2.345, 0.5, 0.0]).unwrap();
        assert_eq!(summarize("out", &t), "out: f32[2, 2] min=-1.234 max=2.345 mean=0.4026");
        let s = Tensor::f32(vec![], vec![0.0123]).unwrap();
        assert_eq!(summarize("s", &s), "s: f32[] min=0.0123 max=0.0123 mean=0.0123");
    }

    #[test]
    fn summary_of_special_values() {
        let t = Tensor::f32(vec![3], vec![f32::NAN, f32::NEG_INFINITY, 1e-7]).unwrap();
        assert_eq!(summarize("w", &t), "w: f32[3] min=-inf max=1.000e-7 mean=-inf nan=1");
        let e = Tensor::f32(vec![0, 4], vec![]).unwrap();
        assert_eq!(summarize("e", &e), "e: f32[0, 4] (empty)");
        let i = Tensor::i32(vec![4], vec![0, 1, 1, 3]).unwrap();
        assert_eq!(summarize("seg", &i), "seg: i32[4] min=0 max=3 mean=1.25");
    }

    #[test]
    fn number_format() {
        assert_eq!(fmt_num(123456.0), "123456");
        assert_eq!(fmt_num(1234567.0), "1.235e6");
        assert_eq!(fmt_num(-0.5), "-0.5");
        assert_eq!(fmt_num(2.0), "2");
    }
}
