//! Pass 3 of the schedule, liveness: each step's reads and writes (the buffers its kernel
//! touches), from which every temporary's lifetime follows ([`Schedule::lifetimes`]). The arena
//! itself is laid out per run shape, when sizes are numbers ([`super::prepare()`]), by those
//! lifetimes.

use super::{BufferKind, Kernel, Schedule, View};

/// Fills in every step's reads and writes.
pub(super) fn liveness(plan: &mut Schedule) {
    for step in &mut plan.steps {
        (step.reads, step.writes) = touches(&step.kernel);
    }
}

/// Buffers a kernel reads and writes.
pub(super) fn touches(k: &Kernel) -> (Vec<usize>, Vec<usize>) {
    let bufs = |views: &[&View]| views.iter().map(|v| v.buf).collect::<Vec<_>>();
    match k {
        Kernel::Elementwise { out, inputs, more, .. } => {
            (inputs.iter().map(|v| v.buf).collect(), std::iter::once(out).chain(more.iter().map(|(o, _)| o)).map(|o| o.buf).collect())
        }
        Kernel::MatMul { a, b, c, .. } => (bufs(&[a, b]), vec![c.buf]),
        Kernel::Reduce { x, out, .. } | Kernel::Softmax { x, out, .. } => (vec![x.buf], vec![out.buf]),
        Kernel::ReduceOf { x, out, .. } => (x.inputs.iter().map(|v| v.buf).collect(), vec![out.buf]),
        Kernel::ArgSort { x, out, scratch, .. } => (vec![x.buf], std::iter::once(out).chain(scratch).map(|v| v.buf).collect()),
        Kernel::Scan { a, x, out, .. } => (a.iter().chain([x]).map(|v| v.buf).collect(), vec![out.buf]),
        Kernel::ScatterAdd { base, idx, src, out, .. } => (bufs(&[base, idx, src]), vec![out.buf]),
        Kernel::PrefixAttention { q, k, v, out, .. } => (bufs(&[q, k, v]), vec![out.buf]),
        Kernel::Dropout { x, seed, out, .. } => (bufs(&[x, seed]), vec![out.buf]),
        Kernel::Norm { x, gamma, beta, out, .. } => {
            let mut r = bufs(&[x, gamma]);
            r.extend(beta.iter().map(|b| b.buf));
            (r, vec![out.buf])
        }
        Kernel::Flash(f) | Kernel::FlashMerge(f) => {
            let mut r = bufs(&[&f.q, &f.k, &f.v]);
            r.extend(f.extras.iter().map(|x| x.buf));
            r.push(f.tiles);
            r.push(f.partials);
            let mut w = vec![f.out.buf, f.partials];
            w.extend(f.lse.iter().map(|x| x.buf));
            (r, w)
        }
        Kernel::FlashBwd(f) => {
            let mut r = bufs(&[&f.q, &f.k, &f.v, &f.d_out]);
            r.extend(f.lse.iter().flat_map(|(a, b)| [a.buf, b.buf]));
            r.extend(f.delta.iter().chain(&f.d_lse).map(|x| x.buf));
            r.extend(f.extras.iter().map(|x| x.buf));
            r.push(f.tiles);
            let mut w: Vec<usize> = [&f.dq, &f.dq_accum, &f.dk, &f.dv].into_iter().flatten().map(|x| x.buf).collect();
            w.push(f.partials);
            (r, w)
        }
        Kernel::FlashBwdReduce(f) => (vec![f.partials], f.dx.iter().map(|(_, x)| x.buf).collect()),
    }
}

impl Schedule {
    /// For each temporary buffer, the first and last step that touches it (inclusive); `None`
    /// for buffers no step touches and for non-temporaries.
    pub fn lifetimes(&self) -> Vec<Option<(usize, usize)>> {
        let mut out: Vec<Option<(usize, usize)>> = vec![None; self.buffers.len()];
        for (s, step) in self.steps.iter().enumerate() {
            for b in step.reads.iter().chain(&step.writes) {
                if self.buffers.get(*b).is_none_or(|x| x.kind != BufferKind::Temp) {
                    continue;
                }
                out[*b] = Some(match out[*b] {
                    None => (s, s),
                    Some((a, _)) => (a, s),
                });
            }
        }
        out
    }
}
