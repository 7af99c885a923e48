//! Scalar helpers generated code calls for the rare operations that have no Cranelift
//! instruction and are not worth inlining (log, sin, cos, pow, Python's `%`, f16 rounding). The hot
//! transcendental functions (exp, tanh, sigmoid, erf) are inlined instead; the dense tile products
//! and the softmax exp pass are the microkernels of [`attn_kernels`].

use attn_compiler::ir::semantics;

/// Natural log.
pub extern "C" fn attnc_log_f64(x: f64) -> f64 {
    x.ln()
}

/// Sine, in f64 (the caller rounds to f32).
pub extern "C" fn attnc_sin_f64(x: f64) -> f64 {
    x.sin()
}

/// Cosine, in f64.
pub extern "C" fn attnc_cos_f64(x: f64) -> f64 {
    x.cos()
}

/// `atan2(y, x)`, in f64.
pub extern "C" fn attnc_atan2_f64(y: f64, x: f64) -> f64 {
    y.atan2(x)
}

/// `x ** y`.
pub extern "C" fn attnc_pow_f64(x: f64, y: f64) -> f64 {
    x.powf(y)
}

/// Float `a % b`: [`semantics::rem_f`] (the sign of `b`, NaN for `b = 0`).
pub extern "C" fn attnc_rem_f64(a: f64, b: f64) -> f64 {
    semantics::rem_f(a, b)
}

/// The nearest f16 value of `x`, as f32.
pub extern "C" fn attnc_round_f16(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

/// The stable sorting permutation of one row ([`semantics::sorts_before`]): `n` elements at
/// `x` (f32, or i32 when `flags & 2`), `x_stride` elements apart; the first `places` entries of
/// their order (i32) into `out`, `out_stride` apart (the rest is not written); descending when
/// `flags & 1`. Fewer places than elements select them first (`topk`: linear for one place)
/// instead of sorting the row.
///
/// # Safety
/// `x` and `out` address `n` elements at their strides (generated code passes a row of a view
/// it owns).
pub unsafe extern "C" fn attnc_argsort_row(x: *const u8, x_stride: i64, n: i64, out: *mut i32, out_stride: i64, flags: i32, places: i64) {
    let n = usize::try_from(n).unwrap_or(0);
    let places = usize::try_from(places).unwrap_or(0).min(n);
    if places == 0 {
        return;
    }
    let read = |i: usize| -> f64 {
        let at = (i as i64).wrapping_mul(x_stride) as isize;
        // SAFETY: row element i of the caller's view.
        unsafe { if flags & 2 != 0 { f64::from(*x.cast::<i32>().offset(at)) } else { f64::from(*x.cast::<f32>().offset(at)) } }
    };
    let descending = flags & 1 != 0;
    let write = |rank: usize, i: u32| {
        // SAFETY: row element `rank < n` of the caller's output view.
        unsafe { *out.offset((rank as i64).wrapping_mul(out_stride) as isize) = i as i32 };
    };
    // (key, index) pairs are distinct, so any sort of them is the stable order.
    let key = |i: usize| (semantics::sort_key(read(i), descending), i as u32);
    if places == 1 {
        if let Some((_, i)) = (0..n).map(key).min() {
            write(0, i);
        }
        return;
    }
    // `take` leaves an empty Vec behind; during thread teardown a fresh one is used.
    let mut order = ORDER.try_with(std::cell::Cell::take).unwrap_or_default();
    order.clear();
    order.extend((0..n).map(key));
    if places < n {
        order.select_nth_unstable(places - 1);
        order.truncate(places);
    }
    order.sort_unstable();
    for (rank, (_, i)) in order.iter().enumerate() {
        write(rank, *i);
    }
    let _ = ORDER.try_with(|cell| cell.set(order));
}

thread_local! {
    /// Per-thread `(key, index)` buffer of [`attnc_argsort_row`], reused across rows.
    static ORDER: std::cell::Cell<Vec<(u64, u32)>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Causal linear attention for one batch index ([`attn_kernels::prefix_attention`]): dense
/// f32 `q`, `k` (`s × d`), `v`, `out` (`s × dv`), blocks of `block` positions, from the end when
/// `reverse` is non-zero.
///
/// # Safety
/// The pointers address those dense matrices (generated code passes one batch index of views it
/// owns).
pub unsafe extern "C" fn attnc_prefix_attention(
    q: *const f32,
    k: *const f32,
    v: *const f32,
    out: *mut f32,
    s: i64,
    d: i64,
    dv: i64,
    block: i64,
    reverse: i32,
) {
    let size = |n: i64| usize::try_from(n).unwrap_or(0);
    let (s, d, dv) = (size(s), size(d), size(dv));
    // SAFETY: the caller's contract.
    let (q, k, v, out) = unsafe {
        (
            std::slice::from_raw_parts(q, s * d),
            std::slice::from_raw_parts(k, s * d),
            std::slice::from_raw_parts(v, s * dv),
            std::slice::from_raw_parts_mut(out, s * dv),
        )
    };
    // The slices are exactly the sizes asked for, so this cannot fail.
    let _ = attn_kernels::prefix_attention(q, k, v, out, (s, d, dv), size(block), reverse != 0);
}

/// Records an index out of range in a run's fault record (`site + 1`, axis, index, size as
/// i32; the first fault wins, later ones leave it as it is).
///
/// # Safety
/// `record` addresses the run's four-word fault record (generated code passes the
/// `BufferKind::Fault` buffer), which outlives the run's threads.
pub unsafe extern "C" fn attnc_index_fault(record: *mut i32, site: i64, axis: i64, index: i64, size: i64) {
    use std::sync::atomic::{AtomicI32, Ordering};
    let word = |k: usize| {
        // SAFETY: the record holds four aligned i32 words; other threads touch them only
        // through these atomics.
        unsafe { AtomicI32::from_ptr(record.add(k)) }
    };
    let tag = i32::try_from(site.saturating_add(1)).unwrap_or(i32::MAX);
    if word(0).compare_exchange(0, tag, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
        let clip = |x: i64| i32::try_from(x).unwrap_or(if x < 0 { i32::MIN } else { i32::MAX });
        word(1).store(clip(axis), Ordering::Relaxed);
        word(2).store(clip(index), Ordering::Relaxed);
        word(3).store(clip(size), Ordering::Relaxed);
    }
}
