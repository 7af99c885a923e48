//! Everything that depends on a run's shape, computed once per shape and reused: the integer
//! table, tuning choices (block sizes, key splits), tile tables, buffer sizes, and the arena
//! that holds every intermediate (placed by lifetime, so buffers whose steps do not overlap
//! share memory).

use super::CpuError;
use attn_compiler::codegen::clif::{BufferKind, CHUNK_COLS, CHUNK_ROWS, IntValue, Kernel, Plan, Tuning, flash_scratch, tile_entry_bytes};
use attn_compiler::interp::{InterpError, MAX_ELEMENTS};
use attn_compiler::ir::{Dim, ScoreExpr, TileClass, classify_tile};
use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::collections::HashMap;
use std::ptr::NonNull;

/// 64-byte aligned, zero-initialised memory.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: plain owned memory, like a `Vec<u8>`.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only hands out the raw pointer; writers synchronise externally.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    const ALIGN: usize = 64;

    /// `len` zero bytes.
    pub fn new(len: usize) -> Result<AlignedBuf, CpuError> {
        if len == 0 {
            // A well-aligned dangling pointer; never dereferenced for zero bytes.
            let ptr = NonNull::new(Self::ALIGN as *mut u8).ok_or(CpuError::OutOfMemory { bytes: 0 })?;
            return Ok(AlignedBuf { ptr, len: 0 });
        }
        let layout = Layout::from_size_align(len, Self::ALIGN).map_err(|_| CpuError::OutOfMemory { bytes: len })?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or(CpuError::OutOfMemory { bytes: len })?;
        Ok(AlignedBuf { ptr, len })
    }

    /// The first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.len > 0
            && let Ok(layout) = Layout::from_size_align(self.len, Self::ALIGN)
        {
            // SAFETY: allocated in `new` with this layout.
            unsafe { dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

/// Memory the runtime holds for one run shape, beyond the caller's inputs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AllocStats {
    /// Bytes of the intermediate arena.
    pub arena_bytes: usize,
    /// Intermediate buffers placed in the arena.
    pub temps: usize,
    /// The largest intermediate, in bytes.
    pub largest_temp_bytes: usize,
    /// Bytes of the outputs (allocated per run and handed to the caller).
    pub output_bytes: usize,
    /// Bytes of flash tile tables.
    pub tile_table_bytes: usize,
    /// Bytes of flash partial states (split keys).
    pub partial_bytes: usize,
    /// Scratch bytes per thread.
    pub scratch_bytes_per_thread: usize,
}

impl AllocStats {
    /// Everything held for the shape with `threads` threads (outputs excluded).
    pub fn extra_bytes(&self, threads: usize) -> usize {
        self.arena_bytes + self.tile_table_bytes + self.partial_bytes + self.scratch_bytes_per_thread * threads
    }
}

/// The per-shape state of a compiled entry.
pub struct ShapeState {
    /// The dims it was built for (sorted), its cache key.
    pub key: Vec<(String, i64)>,
    /// The evaluated integer table.
    pub ints: Vec<i64>,
    /// Elements per buffer.
    pub elems: Vec<usize>,
    /// Byte offset in the arena of each temporary.
    pub offsets: Vec<Option<usize>>,
    /// Intermediates.
    pub arena: AlignedBuf,
    /// Tile tables and partial states, by buffer slot.
    pub side: HashMap<usize, AlignedBuf>,
    /// Scratch bytes each thread needs.
    pub scratch_bytes: usize,
    /// What is allocated.
    pub stats: AllocStats,
}

fn eval(d: &Dim, env: &HashMap<String, i64>) -> Result<i64, CpuError> {
    let overflow = || CpuError::Input(InterpError::Overflow { what: format!("dimension {d}") });
    let mut total: i64 = 0;
    for (mono, coef) in d.terms() {
        let mut term = coef;
        for name in mono {
            let v = env.get(name).ok_or_else(|| CpuError::Input(InterpError::UnboundDim { name: name.clone() }))?;
            term = term.checked_mul(*v).ok_or_else(overflow)?;
        }
        total = total.checked_add(term).ok_or_else(overflow)?;
    }
    Ok(total)
}

fn count(n: i64, what: &str) -> Result<usize, CpuError> {
    match usize::try_from(n) {
        Ok(v) if v <= MAX_ELEMENTS => Ok(v),
        _ => Err(CpuError::Input(InterpError::TooLarge { what: what.to_string(), shape: vec![n.max(0) as usize], limit: MAX_ELEMENTS })),
    }
}

/// Tuning values the runtime chooses per shape. They depend on the shape only (never on the
/// thread count), so results are identical for any number of threads.
struct FlashChoice {
    bm: i64,
    bn: i64,
    splits: i64,
    kps: i64,
    nqb: i64,
    nkb: i64,
    batch: i64,
}

/// Query rows per flash work item and keys per tile. Without a mask, large tiles amortise the
/// per-row softmax bookkeeping and the packing of each K tile (once per query block): 512-row
/// blocks ran 5–8% faster than 128-row ones at S = 1024–4096 (`attnc bench examples/sdpa.attn`,
/// D = 64 and 128, 1 and 2 threads), so they are used wherever they still leave at least
/// [`MIN_ITEMS`] work items. With a mask, small tiles skip more of the masked area. Decode
/// shapes (few query rows) take every row at once and long key tiles.
/// `ATTNC_FLASH_BLOCKS=BM,BN` overrides them for prefill shapes (a tuning knob; every choice
/// computes the same result).
fn flash_blocks(m: i64, batch: i64, masked: bool) -> (i64, i64) {
    if m <= 16 {
        return (m.max(1), 256);
    }
    let forced = std::env::var("ATTNC_FLASH_BLOCKS").ok().and_then(|s| {
        let (a, b) = s.split_once(',')?;
        // Key tiles stay within what a chunk's key extent (one byte) can describe.
        Some((a.trim().parse::<i64>().ok()?.max(1), b.trim().parse::<i64>().ok()?.clamp(1, 255 * CHUNK_COLS)))
    });
    let items = |bm: i64| batch.saturating_mul((m + bm - 1) / bm);
    forced.unwrap_or(if masked {
        // Long masked rows: fewer K packs outweigh the larger diagonal tiles (7% at S = 4096,
        // D = 128; even at S = 2048, worse at 1024).
        if m >= 4096 && items(256) >= MIN_ITEMS { (256, 256) } else { (128, 128) }
    } else if m >= 512 && items(512) >= MIN_ITEMS {
        (512, 256)
    } else if m >= 128 {
        (128, 256)
    } else {
        (64, 256)
    })
}

/// Fewest work items (batch × query blocks) the large unmasked blocks must leave, so that up to
/// this many threads stay busy.
const MIN_ITEMS: i64 = 8;

/// The keys of the tile `cols` the query rows `rows` can keep, as `[lo, hi)` in units of
/// [`CHUNK_COLS`] from `cols.0`: every key before `lo` and from `hi` on is masked for these
/// rows. Binary searches: a masked prefix or suffix stays masked as it shrinks.
fn key_span(mask: Option<&ScoreExpr>, batch: &[i64], rows: (i64, i64), cols: (i64, i64), env: &HashMap<String, i64>) -> (u8, u8) {
    let units = (cols.1 - cols.0 + CHUNK_COLS - 1) / CHUNK_COLS;
    let at = |u: i64| (cols.0 + u * CHUNK_COLS).min(cols.1);
    let skip = |range: (i64, i64)| classify_tile(mask, batch, rows, range, env) == TileClass::Skip;
    // Smallest `hi` with `[at(hi), end)` masked.
    let (mut lo, mut hi) = (0, units);
    while lo < hi {
        let mid = (lo + hi) / 2;
        if skip((at(mid), cols.1)) { hi = mid } else { lo = mid + 1 }
    }
    let end = lo;
    // Largest `lo ≤ end` with `[start, at(lo))` masked.
    let (mut lo, mut hi) = (0, end);
    while lo < hi {
        let mid = (lo + hi + 1) / 2;
        if skip((cols.0, at(mid))) { lo = mid } else { hi = mid - 1 }
    }
    let byte = |u: i64| u8::try_from(u).unwrap_or(u8::MAX);
    (byte(lo), byte(end))
}

/// Keys per split for decode-like shapes (few query rows): splitting lets every thread work on
/// one head's long key range, and the merge is cheap.
const SPLIT_KEYS: i64 = 2048;

fn flash_choice(m: i64, n: i64, batch: i64, masked: bool) -> FlashChoice {
    let (bm, bn) = flash_blocks(m, batch, masked);
    let nqb = (m + bm - 1) / bm;
    let nkb = (n + bn - 1) / bn;
    let splits = if m <= 16 && n >= 2 * SPLIT_KEYS { (n + SPLIT_KEYS - 1) / SPLIT_KEYS } else { 1 };
    let kps = ((n + splits - 1) / splits + bn - 1) / bn * bn;
    FlashChoice { bm, bn, splits, kps: kps.max(bn), nqb, nkb, batch }
}

/// Rows of C per matmul work item: half of the rows (two items per matrix, or more across a
/// batch) but at least 64 and at most 512, so that `B`, which the microkernel packs per call,
/// is packed a few times rather than once per 64 rows (512-row items made
/// `transformer_block.attn` at S = 1024 7–8% faster than 256-row ones on 1 and 2 threads).
/// `ATTNC_MATMUL_ROWS` overrides it (a tuning knob; every choice computes the same result).
fn matmul_rows(m: i64) -> i64 {
    let forced = std::env::var("ATTNC_MATMUL_ROWS").ok().and_then(|s| s.trim().parse::<i64>().ok());
    forced.unwrap_or(((m + 1) / 2).clamp(64, 512)).clamp(1, m.max(1))
}

impl ShapeState {
    /// Builds the state for the dims `env` (already bound and checked against the inputs).
    pub fn new(plan: &Plan, env: &HashMap<String, i64>) -> Result<ShapeState, CpuError> {
        let mut key: Vec<(String, i64)> = env.iter().map(|(k, v)| (k.clone(), *v)).collect();
        key.sort();
        for c in &plan.checks {
            let (start, end, size) = (eval(&c.start, env)?, eval(&c.end, env)?, eval(&c.size, env)?);
            if !(0 <= start && start <= end && end <= size) {
                return Err(CpuError::Input(InterpError::OutOfRange {
                    node: c.node.clone(),
                    axis: c.axis,
                    start,
                    end,
                    size: size.max(0) as usize,
                }));
            }
        }
        let mut tuning: HashMap<(usize, Tuning), i64> = HashMap::new();
        let mut side = HashMap::new();
        let mut stats = AllocStats::default();
        let mut scratch_bytes = 0usize;
        for (s, step) in plan.steps.iter().enumerate() {
            match &step.kernel {
                Kernel::MatMul { c, .. } => {
                    let r = c.shape.len();
                    let m = eval(&c.shape[r - 2], env)?;
                    let mut batch = 1i64;
                    for d in &c.shape[..r - 2] {
                        batch = batch.saturating_mul(eval(d, env)?);
                    }
                    let mb = matmul_rows(m);
                    tuning.insert((s, Tuning::MatMulRows), mb);
                    tuning.insert((s, Tuning::Items), batch.saturating_mul((m + mb - 1) / mb));
                }
                Kernel::Flash(f) => {
                    let r = f.q.shape.len();
                    let (m, n) = (eval(&f.q.shape[r - 2], env)?, eval(&f.k.shape[r - 2], env)?);
                    let dv = eval(&f.v.shape[r - 1], env)?;
                    let batch_sizes: Vec<i64> = f.out.shape[..r - 2].iter().map(|d| eval(d, env)).collect::<Result<_, _>>()?;
                    let batch = batch_sizes.iter().product::<i64>();
                    let ch = flash_choice(m, n, batch, f.spec.mask.is_some());
                    for (p, v) in [
                        (Tuning::BlockM, ch.bm),
                        (Tuning::BlockN, ch.bn),
                        (Tuning::Splits, ch.splits),
                        (Tuning::KeysPerSplit, ch.kps),
                        (Tuning::QueryBlocks, ch.nqb),
                        (Tuning::KeyBlocks, ch.nkb),
                        (Tuning::Items, ch.batch * ch.nqb * ch.splits),
                    ] {
                        tuning.insert((s, p), v);
                    }
                    // The tile table: per (query block, key tile), for every batch index, the
                    // class and, for partial tiles, each row chunk's key extent.
                    let entry = tile_entry_bytes(ch.bm as usize);
                    let table_len = count(ch.nqb * ch.nkb, "flash tile table")?.saturating_mul(entry);
                    let tiles = AlignedBuf::new(table_len)?;
                    let mask = f.spec.mask.as_ref();
                    for qb in 0..ch.nqb {
                        for kb in 0..ch.nkb {
                            let rows = (qb * ch.bm, ((qb + 1) * ch.bm).min(m));
                            let cols = (kb * ch.bn, ((kb + 1) * ch.bn).min(n));
                            let class = classify_tile(mask, &batch_sizes, rows, cols, env);
                            let mut bytes = vec![0u8; entry];
                            bytes[0] = match class {
                                TileClass::Skip => 0,
                                TileClass::Full => 1,
                                TileClass::Partial => 2,
                            };
                            if class == TileClass::Partial {
                                for (c, b) in bytes[1..].chunks_exact_mut(2).enumerate() {
                                    let r0 = rows.0 + (c * CHUNK_ROWS) as i64;
                                    let chunk = (r0.min(rows.1), (r0 + CHUNK_ROWS as i64).min(rows.1));
                                    (b[0], b[1]) = key_span(mask, &batch_sizes, chunk, cols, env);
                                }
                            }
                            let at = (qb * ch.nkb + kb) as usize * entry;
                            // SAFETY: `at + entry ≤ nqb · nkb · entry = table_len`.
                            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), tiles.as_ptr().add(at), entry) };
                        }
                    }
                    stats.tile_table_bytes += tiles.len();
                    side.insert(f.tiles, tiles);
                    let partial_floats = if ch.splits > 1 { ch.batch * ch.nqb * ch.splits * ch.bm * (dv + 2) } else { 0 };
                    let partials = AlignedBuf::new(count(partial_floats, "flash partial states")? * 4)?;
                    stats.partial_bytes += partials.len();
                    side.insert(f.partials, partials);
                    let layout = flash_scratch(ch.bm as usize, ch.bn as usize, dv.max(0) as usize);
                    scratch_bytes = scratch_bytes.max(layout.total);
                }
                Kernel::FlashMerge(f) => {
                    let fl = |p| tuning.get(&(f.step, p)).copied().unwrap_or(0);
                    let (splits, nqb, items) = (fl(Tuning::Splits), fl(Tuning::QueryBlocks), fl(Tuning::Items));
                    let merge = if splits > 1 { items / splits } else { 0 };
                    let _ = nqb;
                    tuning.insert((s, Tuning::Items), merge);
                }
                _ => {}
            }
        }
        let mut ints = Vec::with_capacity(plan.ints.len());
        for v in &plan.ints {
            ints.push(match v {
                IntValue::Dim(d) => eval(d, env)?,
                IntValue::Tuning { step, param } => tuning
                    .get(&(*step, *param))
                    .copied()
                    .ok_or_else(|| CpuError::Internal(format!("no {param:?} chosen for step {step}")))?,
            });
        }
        let mut elems = Vec::with_capacity(plan.buffers.len());
        for b in &plan.buffers {
            elems.push(match b.kind {
                BufferKind::TileTable { .. } | BufferKind::Partials { .. } => 0,
                _ => count(eval(&b.elems, env)?, &format!("%{}", b.value))?,
            });
        }
        let offsets = place(plan, &elems);
        let arena_bytes = offsets.iter().zip(&elems).filter_map(|(o, n)| o.map(|o| o + n * 4)).max().unwrap_or(0);
        for (b, buf) in plan.buffers.iter().enumerate() {
            match buf.kind {
                BufferKind::Temp if offsets[b].is_some() => {
                    stats.temps += 1;
                    stats.largest_temp_bytes = stats.largest_temp_bytes.max(elems[b] * 4);
                }
                BufferKind::Output(_) => stats.output_bytes += elems[b] * 4,
                _ => {}
            }
        }
        stats.arena_bytes = arena_bytes;
        stats.scratch_bytes_per_thread = scratch_bytes;
        let arena = AlignedBuf::new(arena_bytes)?;
        Ok(ShapeState { key, ints, elems, offsets, arena, side, scratch_bytes, stats })
    }
}

/// Places every temporary in the arena: first fit by offset among the buffers whose lifetimes
/// overlap, 64-byte aligned. Returns byte offsets.
fn place(plan: &Plan, elems: &[usize]) -> Vec<Option<usize>> {
    let life = plan.lifetimes();
    let mut order: Vec<usize> = (0..plan.buffers.len()).filter(|b| life[*b].is_some()).collect();
    order.sort_by_key(|b| (life[*b].map(|l| l.0), std::cmp::Reverse(elems[*b])));
    let mut placed: Vec<(usize, usize, (usize, usize))> = Vec::new();
    let mut out = vec![None; plan.buffers.len()];
    for b in order {
        let Some((first, last)) = life[b] else { continue };
        let size = (elems[b] * 4).div_ceil(64) * 64;
        let mut busy: Vec<(usize, usize)> =
            placed.iter().filter(|(_, _, (f, l))| *f <= last && first <= *l).map(|(o, s, _)| (*o, *s)).collect();
        busy.sort();
        let mut at = 0usize;
        for (o, s) in busy {
            if at + size <= o {
                break;
            }
            at = at.max(o + s);
        }
        placed.push((at, size, (first, last)));
        out[b] = Some(at);
    }
    out
}
