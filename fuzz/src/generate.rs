//! Random well-typed attention programs for the `differential` target, written as `.attn`
//! source: `softmax(mask(F(q @ kᵀ))) @ v` with a random score modification chain `F` (scales,
//! ALiBi, relative-bias gathers, soft-capping, element-wise ops), a random mask (causal, sliding
//! window, prefix-LM, document, key padding, masks that leave rows empty, none), written in the
//! language's several spellings, sometimes through a helper function, sometimes returning the
//! weights too. Only operations continuous in the scores are generated (no `floor`, `%` or
//! comparisons of scores), so the CPU's different (but correct) rounding of `q @ kᵀ` cannot flip
//! a result.
//!
//! Every program this module writes must check: a check failure is a bug here, and the target
//! asserts on it.

use arbitrary::{Result, Unstructured};
use std::fmt::Write;

/// One generated program and how to run it.
#[derive(Clone, Debug)]
pub struct Case {
    /// The `.attn` source.
    pub source: String,
    /// The function to run (the last one).
    pub entry: String,
    /// The size of every dim the entry's parameters use.
    pub dims: Vec<(String, i64)>,
    /// Seed of the random inputs (`Program::random_inputs`).
    pub seed: u64,
    /// CPU threads.
    pub threads: usize,
    /// Whether the CPU target optimizes the graph (fusing attention) or runs it as lowered.
    pub optimize: bool,
    /// `CpuPolicy::flash_blocks`: small tiles, so that sequences of a few dozen positions are
    /// several tiles and the block classification (skip, full, partial) matters.
    pub flash_blocks: Option<(i64, i64)>,
    /// `CpuPolicy::matmul_rows`.
    pub matmul_rows: Option<i64>,
}

impl std::fmt::Display for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let dims: Vec<String> = self.dims.iter().map(|(n, v)| format!("{n}={v}")).collect();
        writeln!(
            f,
            "# entry {}, dims {}, seed {}, threads {}, optimize {}, flash_blocks {:?}, matmul_rows {:?}",
            self.entry,
            dims.join(" "),
            self.seed,
            self.threads,
            self.optimize,
            self.flash_blocks,
            self.matmul_rows
        )?;
        f.write_str(&self.source)
    }
}

/// Float literals for scales and offsets (the language needs digits on both sides of the point).
const SCALES: &[&str] = &["0.5", "2.0", "0.125", "1.5", "0.3", "1.0"];
/// Soft-capping constants.
const CAPS: &[&str] = &["1.0", "5.0", "20.0", "50.0", "0.5"];

/// What the program needs besides `q`, `k`, `v`.
#[derive(Default)]
struct Needs {
    slopes: bool,
    bias: bool,
    /// The largest clamp radius `K` of the relative-bias gathers: the table needs `2 K + 1`
    /// entries per head (a gather out of range is an error, in the interpreter as on every
    /// target).
    bias_radius: i64,
    seg: bool,
    len: bool,
    /// A dense bool mask input (`keep[b, i, j]`, or `keep[b, 0, i, j]` broadcast over heads).
    keep: bool,
    consts: Vec<(String, String)>,
}

impl Needs {
    /// An integer constant: a `const` item or the literal itself.
    fn int(&mut self, u: &mut Unstructured, name: &str, range: std::ops::RangeInclusive<i64>) -> Result<String> {
        Ok(self.int_valued(u, name, range)?.0)
    }

    /// [`Self::int`] and the value it stands for.
    fn int_valued(&mut self, u: &mut Unstructured, name: &str, range: std::ops::RangeInclusive<i64>) -> Result<(String, i64)> {
        let value = u.int_in_range(range)?;
        if u.ratio(1, 2)? {
            // A second use of the name keeps the first value.
            match self.consts.iter().find(|(n, _)| n == name) {
                Some((_, first)) => Ok((name.to_string(), first.parse().unwrap_or(value))),
                None => {
                    self.consts.push((name.to_string(), value.to_string()));
                    Ok((name.to_string(), value))
                }
            }
        } else {
            Ok((value.to_string(), value))
        }
    }
}

/// The shape the generator works with.
struct Shape {
    rank4: bool,
    cross: bool,
    /// The query and key dim names (`S`, and `T` or `S`).
    sq: &'static str,
    sk: &'static str,
    /// The value width's name (`E`, or `D`).
    dv: &'static str,
}

impl Shape {
    /// `f32[B, H, X, Y]` or `f32[B, X, Y]`.
    fn ty(&self, x: &str, y: &str) -> String {
        if self.rank4 { format!("f32[B, H, {x}, {y}]") } else { format!("f32[B, {x}, {y}]") }
    }

    fn positions(&self) -> &'static str {
        if self.rank4 { "(b, h, i, j)" } else { "(b, i, j)" }
    }
}

/// A random program from `u`.
pub fn generate(u: &mut Unstructured) -> Result<Case> {
    let rank4 = u.ratio(4, 5)?;
    let cross = u.ratio(1, 3)?;
    let own_dv = u.ratio(1, 3)?;
    let shape = Shape { rank4, cross, sq: "S", sk: if cross { "T" } else { "S" }, dv: if own_dv { "E" } else { "D" } };
    // Mostly up to 17 positions; a quarter longer, so that the small forced tiles below make
    // several tiles per row (the CPU policy takes every row at once below 17 query rows).
    let long = u.ratio(1, 4)?;
    let len_range = if long { 17..=48 } else { 1..=17 };
    let mut dims = vec![("B".to_string(), u.int_in_range(1..=2)?)];
    if rank4 {
        dims.push(("H".to_string(), u.int_in_range(1..=2)?));
    }
    dims.push(("S".to_string(), u.int_in_range(len_range.clone())?));
    if cross {
        dims.push(("T".to_string(), u.int_in_range(len_range)?));
    }
    dims.push(("D".to_string(), u.int_in_range(1..=9)?));
    if own_dv {
        dims.push(("E".to_string(), u.int_in_range(1..=9)?));
    }

    let mut needs = Needs::default();
    let mut body = String::new();
    let mut helper = None;

    // The scores.
    let scores = match u.int_in_range(0..=6)? {
        0 => "q @ k.T / sqrt(D)".to_string(),
        1 => format!("q @ k.T * {}", u.choose(SCALES)?),
        2 => "q @ k.T".to_string(),
        3 => format!("(q * {}) @ k.T", u.choose(SCALES)?),
        4 => "q @ transpose(k, -2, -1) / sqrt(D)".to_string(),
        5 => "matmul(q, k.T) / 3.0".to_string(),
        _ => {
            // Through a helper with its own dim names (inlined; dims bound at the call).
            let (ta, tc, tr) = if rank4 {
                ("f32[Bq, Hq, M, C]", "f32[Bq, Hq, N, C]", "f32[Bq, Hq, M, N]")
            } else {
                ("f32[Bq, M, C]", "f32[Bq, N, C]", "f32[Bq, M, N]")
            };
            helper = Some(format!("fn scores(a: {ta}, c: {tc}) -> {tr} {{\n    return a @ c.T / sqrt(C)\n}}\n\n"));
            if u.ratio(1, 2)? { "scores(q, k)".to_string() } else { "q.scores(k)".to_string() }
        }
    };
    let _ = writeln!(body, "    let s0 = {scores}");
    let _ = writeln!(body, "    let {} = indices(s0)", shape.positions());

    // The mask, and where it goes: last (as `where`, or additive), or in the middle of the chain.
    let mask = mask(u, &shape, &mut needs)?;
    let mods = u.int_in_range(0..=3)?;
    let mask_at = if mask.is_some() && mods > 0 && u.ratio(1, 6)? { u.int_in_range(0..=mods - 1)? } else { mods };
    let additive = u.ratio(1, 6)?;
    let mut last = "s0".to_string();
    for n in 0..=mods {
        if n == mask_at
            && let Some(m) = &mask
        {
            let masked = if additive { format!("{last} + where({m}, 0.0, -inf)") } else { format!("where({m}, {last}, -inf)") };
            let name = format!("m{n}");
            let _ = writeln!(body, "    let {name} = {masked}");
            last = name;
        }
        if n == mods {
            break;
        }
        let e = modification(u, &shape, &mut needs, &last)?;
        let name = format!("s{}", n + 1);
        let _ = writeln!(body, "    let {name} = {e}");
        last = name;
    }

    // The weights.
    let weights = match u.int_in_range(0..=9)? {
        0 => format!("{last}.softmax(axis = -1)"),
        1 => format!("softmax({last})"),
        2 => format!("softmax({last}, axis = {})", if rank4 { 3 } else { 2 }),
        3 if cross => format!("softmax({last}, axis = T)"),
        4 => format!("sigmoid({last})"),
        5 => {
            let _ = writeln!(body, "    let mx = max({last}, axis = -1, keepdim = true)");
            let _ = writeln!(body, "    let ex = exp({last} - mx)");
            "ex / sum(ex, axis = -1, keepdim = true)".to_string()
        }
        _ => format!("softmax({last}, axis = -1)"),
    };
    let _ = writeln!(body, "    let w = {weights}");
    let product = if u.ratio(1, 4)? { "matmul(w, v)" } else { "w @ v" };
    let out = match u.int_in_range(0..=5)? {
        0 => format!("{product} * 2.0"),
        1 if !own_dv => format!("{product} + q"),
        _ => product.to_string(),
    };
    let with_weights = u.ratio(1, 10)?;

    // The signature.
    let mut params = vec![
        format!("q: {}", shape.ty(shape.sq, "D")),
        format!("k: {}", shape.ty(shape.sk, "D")),
        format!("v: {}", shape.ty(shape.sk, shape.dv)),
    ];
    if needs.slopes {
        params.push("slopes: f32[H]".to_string());
    }
    if needs.bias {
        params.push("bias: f32[H, R]".to_string());
        // Room for every offset the gathers read, and sometimes entries no offset reaches.
        dims.push(("R".to_string(), 2 * needs.bias_radius + 1 + u.int_in_range(0..=2)?));
    }
    if needs.seg {
        params.push("seg: i32[B, S]".to_string());
    }
    if needs.len {
        params.push("len: i32[B]".to_string());
    }
    if needs.keep {
        params.push(if shape.rank4 {
            format!("keep: bool[B, 1, {}, {}]", shape.sq, shape.sk)
        } else {
            format!("keep: bool[B, {}, {}]", shape.sq, shape.sk)
        });
    }
    let out_ty = shape.ty(shape.sq, shape.dv);
    let ret = if with_weights { format!("(out: {out_ty}, weights: {})", shape.ty(shape.sq, shape.sk)) } else { out_ty };
    let ret_expr = if with_weights { format!("{out}, w") } else { out };

    let mut source = String::new();
    for (name, value) in &needs.consts {
        let _ = writeln!(source, "const {name} = {value}");
    }
    if !needs.consts.is_empty() {
        source.push('\n');
    }
    if let Some(h) = helper {
        source.push_str(&h);
    }
    let _ = write!(source, "fn attention({}) -> {ret} {{\n{body}    return {ret_expr}\n}}\n", params.join(", "));

    let seed = u.arbitrary()?;
    let threads = if u.ratio(1, 3)? { 2 } else { 1 };
    let optimize = u.ratio(4, 5)?;
    let flash_blocks = if u.ratio(2, 3)? {
        let sizes = [1, 2, 3, 4, 8, 16, 32];
        Some((*u.choose(&sizes)?, *u.choose(&sizes)?))
    } else {
        None
    };
    let matmul_rows = if u.ratio(1, 3)? { Some(*u.choose(&[1, 3, 8])?) } else { None };
    Ok(Case { source, entry: "attention".to_string(), dims, seed, threads, optimize, flash_blocks, matmul_rows })
}

/// A mask predicate on positions `i` (query) and `j` (key), or none.
fn mask(u: &mut Unstructured, shape: &Shape, needs: &mut Needs) -> Result<Option<String>> {
    Ok(Some(match u.int_in_range(0..=15)? {
        0 | 1 => return Ok(None),
        14 | 15 => {
            needs.keep = true;
            let at = if shape.rank4 { "keep[b, 0, i, j]" } else { "keep[b, i, j]" };
            if u.ratio(1, 2)? { at.to_string() } else { format!("{at} && j <= i") }
        }
        2 => "j <= i".to_string(),
        3 => "j < i".to_string(),
        4 => format!("abs(i - j) <= {}", needs.int(u, "W", 0..=5)?),
        5 => format!("j <= i && i - j < {}", needs.int(u, "W", 0..=5)?),
        6 => format!("j <= i || j < {}", needs.int(u, "P", 0..=6)?),
        7 => {
            format!("abs(i - j) <= {} || i < {} || j < {}", needs.int(u, "W", 0..=5)?, needs.int(u, "G", 0..=3)?, needs.int(u, "G", 0..=3)?)
        }
        8 if shape.cross => "j <= i + (T - S)".to_string(),
        8 => "i >= j".to_string(),
        9 if !shape.cross => {
            needs.seg = true;
            "seg[b, i] == seg[b, j] && j <= i".to_string()
        }
        9 | 10 => {
            needs.len = true;
            "j < len[b]".to_string()
        }
        11 => if u.ratio(1, 2)? { "!(j > i)" } else { "not (j > i)" }.to_string(),
        12 => format!("j + {} < i", needs.int(u, "W", 0..=5)?),
        _ => "j >= i".to_string(),
    }))
}

/// One score modification of `p`.
fn modification(u: &mut Unstructured, shape: &Shape, needs: &mut Needs, p: &str) -> Result<String> {
    let c = *u.choose(SCALES)?;
    Ok(match u.int_in_range(0..=13)? {
        0 => format!("{p} * {c}"),
        1 => format!("{p} / {c}"),
        2 if shape.rank4 => {
            needs.slopes = true;
            format!("{p} + slopes[h] * (j - i)")
        }
        2 => format!("{p} + {c} * (j - i)"),
        3 => {
            let cap = *u.choose(CAPS)?;
            format!("{cap} * tanh({p} / {cap})")
        }
        4 if shape.rank4 => {
            needs.bias = true;
            let (k, radius) = needs.int_valued(u, "K", 0..=3)?;
            needs.bias_radius = needs.bias_radius.max(radius);
            format!("{p} + bias[h, clamp(j - i, -{k}, {k}) + {k}]")
        }
        4 => format!("{p} - {c} * abs(i - j)"),
        5 => format!("{p} + {c}"),
        6 => format!("{p} - {c}"),
        7 => {
            let f = *u.choose(&["abs", "relu", "tanh", "sigmoid", "gelu", "silu", "elu", "neg"])?;
            if u.ratio(1, 2)? { format!("{f}({p})") } else { format!("{p}.{f}()") }
        }
        8 => match u.int_in_range(0..=2)? {
            0 => format!("max({p}, -{c})"),
            1 => format!("min({p}, {c})"),
            _ => format!("clamp({p}, -{c}, {c})"),
        },
        9 => format!("where(j == i, {p} + {c}, {p})"),
        10 => format!("{p} - abs(i - j) / {}", shape.sk),
        11 => format!("{p} * {p} * 0.05"),
        12 => format!("{p} + cast(j <= i, f32) * {c}"),
        _ => format!("exp(tanh({p}))"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Many byte strings (a fixed pseudo-random stream) give programs that all check.
    #[test]
    fn generated_programs_check() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut failures = Vec::new();
        for n in 0..2000 {
            let bytes: Vec<u8> = (0..64 + n % 200)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    state as u8
                })
                .collect();
            let case = generate(&mut Unstructured::new(&bytes)).expect("generates");
            if let Err(diags) = attn_compiler::check(&case.source) {
                failures.push(format!("{case}\n{diags:?}"));
            }
        }
        assert!(failures.is_empty(), "{} programs do not check; the first:\n{}", failures.len(), failures[0]);
    }
}
