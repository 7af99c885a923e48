//! Text for people: each flash op's block classification as comments after the optimised IR
//! (the IR reader skips them).

use super::cost::representative;
use crate::ir::{Graph, Op, tile_census, value_numbers};
use std::collections::HashMap;
use std::fmt::Write;

/// Tile size the classification summary is shown at.
const TILE: i64 = 64;

/// `# %N: …` lines classifying the 64×64 tiles of every flash op at representative sizes.
pub fn block_summary(g: &Graph) -> String {
    let numbers = value_numbers(g);
    let mut out = String::new();
    let mut order = g.topo_order().unwrap_or_default();
    order.sort_by_key(|v| numbers[v.index()]);
    for v in order {
        let Op::Flash(spec) = &g.node(v).op else { continue };
        let ops = g.operands(v);
        let (qt, kt) = (&g.node(ops[0]).ty, &g.node(ops[1]).ty);
        let r = spec.rank;
        let mut env: HashMap<String, i64> = HashMap::new();
        for d in qt.shape.iter().chain(&kt.shape) {
            for s in d.symbols() {
                let size = representative(&s);
                env.insert(s, size);
            }
        }
        let size = |d: &crate::ir::Dim| d.eval(&env).unwrap_or(1);
        let batch: Vec<i64> = qt.shape[..r - 2].iter().map(size).collect();
        let (m, n) = (size(&qt.shape[r - 2]), size(&kt.shape[r - 2]));
        let [skip, full, partial] = tile_census(spec.mask.as_ref(), &batch, (m, n), (TILE, TILE), &env);
        let total = (skip + full + partial).max(1);
        let _ = writeln!(
            out,
            "# %{}: {TILE}x{TILE} tiles at {m}x{n} scores: {full} full, {partial} partial (mask tested), {skip} skipped ({:.0}% of the work)",
            numbers[v.index()],
            100.0 * (full + partial) as f64 / total as f64
        );
    }
    out
}
