//! DOT export (being written).
