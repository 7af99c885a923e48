//! Everything that depends on a run's shape, computed once per shape and reused: the schedule
//! prepared for the dims (integer table, block sizes, tile tables, buffer sizes, the placement
//! of intermediates by lifetime) and the memory it asks for.

use super::CpuError;
use attn_compiler::exec::ExecError;
use attn_compiler::schedule::{BufferKind, Policy, PrepareError, Prepared, Schedule};
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

/// The per-shape state of a compiled entry: the schedule prepared for the dims
/// ([`attn_compiler::schedule::prepare()`]) and the memory it asks for.
pub struct ShapeState {
    /// The launch-time plan: integer table, buffer sizes, tile tables, arena placement.
    pub prepared: Prepared,
    /// Intermediates.
    pub arena: AlignedBuf,
    /// Tile tables and partial states, by buffer slot.
    pub side: HashMap<usize, AlignedBuf>,
    /// What is allocated.
    pub stats: AllocStats,
}

impl ShapeState {
    /// Prepares `schedule` for the dims `env` (already bound and checked against the inputs)
    /// and allocates what it needs.
    /// `data`: the values of the 1-d i32 parameters flash masks read, which classify their tiles
    /// ([`attn_compiler::schedule::prepare_with`]).
    pub fn new(
        schedule: &Schedule,
        env: &HashMap<String, i64>,
        policy: &Policy,
        data: &HashMap<usize, std::sync::Arc<attn_compiler::ir::RangeTable>>,
    ) -> Result<ShapeState, CpuError> {
        let prepared = attn_compiler::schedule::prepare_with(schedule, env, policy, data).map_err(prepare_error)?;
        let mut stats =
            AllocStats { arena_bytes: prepared.arena_bytes, scratch_bytes_per_thread: prepared.scratch_bytes, ..AllocStats::default() };
        let mut side = HashMap::new();
        for (b, buf) in schedule.buffers.iter().enumerate() {
            let bytes = prepared.elems[b] * 4;
            match buf.kind {
                BufferKind::Temp if prepared.arena[b].is_some() => {
                    stats.temps += 1;
                    stats.largest_temp_bytes = stats.largest_temp_bytes.max(bytes);
                }
                BufferKind::Output(_) => stats.output_bytes += bytes,
                BufferKind::Partials { .. } => {
                    stats.partial_bytes += bytes;
                    side.insert(b, AlignedBuf::new(bytes)?);
                }
                _ => {}
            }
        }
        for (b, table) in &prepared.tables {
            let buf = AlignedBuf::new(table.len())?;
            // SAFETY: the buffer holds exactly `table.len()` bytes.
            unsafe { std::ptr::copy_nonoverlapping(table.as_ptr(), buf.as_ptr(), table.len()) };
            stats.tile_table_bytes += table.len();
            side.insert(*b, buf);
        }
        let arena = AlignedBuf::new(prepared.arena_bytes)?;
        Ok(ShapeState { prepared, arena, side, stats })
    }
}

/// A shape the schedule cannot run with, as the input error the interpreter would report.
pub fn prepare_error(e: PrepareError) -> CpuError {
    CpuError::Input(match e {
        PrepareError::UnboundDim(name) => ExecError::UnboundDim { name },
        PrepareError::OutOfRange { node, span, axis, start, end, size } => {
            ExecError::OutOfRange { node, span, axis, start, end, size: size.max(0) as usize }
        }
        PrepareError::TooLarge { what, elements, limit } => ExecError::TooLarge { what, shape: vec![elements.max(0) as usize], limit },
        PrepareError::Negative { dim, value } => ExecError::NegativeDim { node: "a buffer".into(), span: None, dim, value },
        PrepareError::Overflow(what) => ExecError::Overflow { what },
        e @ (PrepareError::AdditiveWidth { .. } | PrepareError::EmptyOperand { .. }) => return CpuError::Unsupported(e),
        other => return CpuError::Internal(other.to_string()),
    })
}
