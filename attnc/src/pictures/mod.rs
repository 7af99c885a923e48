//! Pictures for people: the compile-time tile map of each flash op (PNG and terminal text), the
//! IR graph as SVG (laid out here, no Graphviz needed), and heatmaps of outputs (PNG).
//!
//! Rendering is pure: every function returns bytes or text; only the CLI writes files. PNG
//! encoding is the `png` crate's, text is drawn with an 8×8 bitmap font (`font8x8`), and graph
//! layout is `layout-rs`'s.

pub mod heatmap;
pub mod raster;
pub mod svg;
pub mod tile_map;

/// What can go wrong when drawing.
#[derive(Debug, thiserror::Error)]
pub enum PictureError {
    /// The picture would be larger than this module draws.
    #[error("{what} is too large to draw: {detail}")]
    TooLarge {
        /// What was to be drawn.
        what: String,
        /// The size and the limit.
        detail: String,
    },
    /// The data has a shape this picture cannot show.
    #[error("{0}")]
    Shape(String),
    /// The PNG encoder failed.
    #[error("cannot encode the PNG: {0}")]
    Encode(String),
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, PictureError>;

#[cfg(test)]
mod tests;
