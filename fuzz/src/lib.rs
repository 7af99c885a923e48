//! Shared code of the fuzz targets in `fuzz_targets/` (see `docs/fuzzing.md`): the front-end and
//! middle driver of `source`, the random well-typed program generator and the output comparison
//! of `differential`.

pub mod compare;
pub mod generate;
pub mod pipeline;
