//! `attnc`, the command line of the attnc compiler ([`cli`]: `check`, `build`, `explain`, `run`,
//! `bench`), and the pictures it draws for people ([`pictures`]: tile maps, heatmaps, the IR
//! graph as SVG). The binary (`src/main.rs`) only calls [`cli::main`]; everything it runs goes
//! through `attn-runtime`.

pub mod cli;
pub mod pictures;
