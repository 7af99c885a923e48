//! Diagnostics as plain data: severity, a stable code, a message and labelled spans.
//!
//! Only the driver (the `attnc` binary) renders them; libraries return them.

use crate::span::{Span, line_col};
use std::fmt;

/// How bad a diagnostic is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Severity {
    /// The program is rejected.
    Error,
    /// The program is accepted, but something looks wrong.
    Warning,
}

/// A span with a short explanation, shown under the source line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Label {
    /// Where.
    pub span: Span,
    /// What is there (may be empty).
    pub message: String,
}

/// One problem found in a program.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Diagnostic {
    /// Error or warning.
    pub severity: Severity,
    /// Stable code, e.g. `E0101`; documented in `docs/diagnostics.md`.
    pub code: &'static str,
    /// One sentence.
    pub message: String,
    /// The main location.
    pub primary: Label,
    /// Related locations (e.g. where a shape came from).
    pub secondary: Vec<Label>,
    /// Extra advice, shown after the snippet.
    pub help: Option<String>,
}

impl Diagnostic {
    /// An error with a primary label.
    pub fn error(code: &'static str, message: impl Into<String>, span: Span, label: impl Into<String>) -> Diagnostic {
        Diagnostic {
            severity: Severity::Error,
            code,
            message: message.into(),
            primary: Label { span, message: label.into() },
            secondary: Vec::new(),
            help: None,
        }
    }

    /// A warning with a primary label: the program is accepted.
    pub fn warning(code: &'static str, message: impl Into<String>, span: Span, label: impl Into<String>) -> Diagnostic {
        Diagnostic { severity: Severity::Warning, ..Diagnostic::error(code, message, span, label) }
    }

    /// Adds a secondary label.
    pub fn with_label(mut self, span: Span, message: impl Into<String>) -> Diagnostic {
        self.secondary.push(Label { span, message: message.into() });
        self
    }

    /// Adds a help line.
    pub fn with_help(mut self, help: impl Into<String>) -> Diagnostic {
        self.help = Some(help.into());
        self
    }

    /// Plain-text rendering without colours: `file:line:col: error[CODE]: message`, then the
    /// labelled source lines. Stable, so it is what snapshot tests hold.
    pub fn render_plain(&self, file: &str, source: &str) -> String {
        let mut out = String::new();
        let (line, col) = line_col(source, self.primary.span.start as usize);
        let sev = match self.severity {
            Severity::Error => "error",
            Severity::Warning => "warning",
        };
        out.push_str(&format!("{file}:{line}:{col}: {sev}[{}]: {}\n", self.code, self.message));
        let mut labels = vec![(&self.primary, '^')];
        labels.extend(self.secondary.iter().map(|l| (l, '-')));
        for (label, mark) in labels {
            render_label(&mut out, source, label, mark);
        }
        if let Some(help) = &self.help {
            out.push_str(&format!("  = help: {help}\n"));
        }
        out
    }
}

fn render_label(out: &mut String, source: &str, label: &Label, mark: char) {
    let start = (label.span.start as usize).min(source.len());
    let (line, col) = line_col(source, start);
    let text = source.lines().nth(line - 1).unwrap_or("");
    let width = {
        let end = (label.span.end as usize).min(source.len()).max(start);
        let first_line_end = source[start..end].find('\n').map_or(end, |n| start + n);
        source.get(start..first_line_end).map_or(1, |s| s.chars().count().max(1))
    };
    let gutter = format!("{line}").len();
    out.push_str(&format!("{:gutter$} |\n", ""));
    out.push_str(&format!("{line} | {text}\n"));
    let pad: String = " ".repeat(col - 1);
    let marks: String = std::iter::repeat_n(mark, width).collect();
    let msg = if label.message.is_empty() { String::new() } else { format!(" {}", label.message) };
    out.push_str(&format!("{:gutter$} | {pad}{marks}{msg}\n", ""));
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{}] {}", self.code, self.message)
    }
}

/// Renders every diagnostic with [`Diagnostic::render_plain`].
pub fn render_all(diags: &[Diagnostic], file: &str, source: &str) -> String {
    diags.iter().map(|d| d.render_plain(file, source)).collect::<Vec<_>>().join("\n")
}
