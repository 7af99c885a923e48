//! Pass 4 of the schedule, the integer table: each step's work-item count and the tuning
//! values its kernel reads on this target ([`Tuning`], chosen per run by
//! [`super::prepare()`]), then every dim a renderer reads, so generated code finds each in one
//! slot of [`Schedule::ints`].

use super::policy::Policy;
use super::{Expr, IntValue, Kernel, Schedule, Tuning, View};
use crate::ir::Dim;

/// Registers every integer of `plan`'s steps for `policy`'s target.
pub(super) fn integer_table(plan: &mut Schedule, policy: &Policy) {
    for s in 0..plan.steps.len() {
        plan.steps[s].work = plan.int(IntValue::Tuning { step: s, param: Tuning::Items });
        for t in policy.tunings(&plan.steps[s].kernel) {
            plan.int(IntValue::Tuning { step: s, param: t });
        }
    }
    register_dims(plan);
}

/// Registers every dim a renderer may read: the dims of every view, buffer, check and
/// expression, and every dim symbol on its own (so that any polynomial of them can be formed).
pub(super) fn register_dims(plan: &mut Schedule) {
    let mut dims: Vec<Dim> = Vec::new();
    for d in table_dims(plan) {
        if !dims.contains(&d) {
            dims.push(d);
        }
    }
    let mut symbols: Vec<String> = dims.iter().flat_map(|d| d.symbols()).collect();
    symbols.sort();
    symbols.dedup();
    for s in symbols {
        plan.int(IntValue::Dim(Dim::sym(&s)));
    }
    for d in dims {
        plan.int(IntValue::Dim(d));
    }
}

/// Every non-constant dim the renderers may read, in the order the table lists them: buffer
/// sizes, slice bounds, then each step's views and expressions ([`visit_kernel`]).
pub(super) fn table_dims(plan: &Schedule) -> Vec<Dim> {
    let mut dims: Vec<Dim> = Vec::new();
    dims.extend(plan.buffers.iter().map(|b| b.elems.clone()));
    dims.extend(plan.checks.iter().flat_map(|c| [c.start.clone(), c.end.clone(), c.size.clone()]));
    for s in &plan.steps {
        visit_kernel(&s.kernel, &mut |x| match x {
            Named::View(v) => dims.extend(std::iter::once(&v.offset).chain(&v.shape).chain(&v.strides).cloned()),
            Named::Dim(d) => dims.push(d.clone()),
        });
    }
    dims.retain(|d| d.as_const().is_none());
    dims
}

/// What a kernel names: a view, or a dim one of its expressions reads.
pub(super) enum Named<'a> {
    /// A view the kernel reads or writes.
    View(&'a View),
    /// A dim an expression reads.
    Dim(&'a Dim),
}

/// Calls `f` on every view a kernel names (read or written) and every dim its expressions read,
/// in a fixed order.
pub(super) fn visit_kernel(k: &Kernel, f: &mut dyn FnMut(Named)) {
    let views = |vs: &[Option<&View>], f: &mut dyn FnMut(Named)| vs.iter().flatten().for_each(|v| f(Named::View(v)));
    let expr = |e: &Expr, f: &mut dyn FnMut(Named)| {
        e.visit(&mut |e| {
            if let Expr::Dim(d) = e {
                f(Named::Dim(d));
            }
        })
    };
    match k {
        Kernel::Elementwise { out, inputs, expr: e, more } => {
            f(Named::View(out));
            inputs.iter().for_each(|v| f(Named::View(v)));
            for (o, e) in std::iter::once((out, e)).chain(more.iter().map(|(o, e)| (o, e))) {
                f(Named::View(o));
                expr(e, f);
            }
        }
        Kernel::MatMul { a, b, c, .. } => views(&[Some(a), Some(b), Some(c)], f),
        Kernel::Reduce { x, out, .. } | Kernel::Softmax { x, out, .. } => views(&[Some(x), Some(out)], f),
        Kernel::ReduceOf { x, out, .. } => {
            x.inputs.iter().chain([out]).for_each(|v| f(Named::View(v)));
            x.shape.iter().for_each(|d| f(Named::Dim(d)));
            expr(&x.expr, f);
        }
        Kernel::ArgSort { x, out, scratch, .. } => views(&[Some(x), Some(out), scratch.as_ref()], f),
        Kernel::Scan { a, x, out, .. } => views(&[a.as_ref(), Some(x), Some(out)], f),
        Kernel::ScatterAdd { base, idx, src, out, .. } => views(&[Some(base), Some(idx), Some(src), Some(out)], f),
        Kernel::PrefixAttention { q, k, v, out, .. } => views(&[Some(q), Some(k), Some(v), Some(out)], f),
        Kernel::Norm { x, gamma, beta, out, .. } => views(&[Some(x), Some(gamma), beta.as_ref(), Some(out)], f),
        Kernel::Dropout { x, seed, out, .. } => views(&[Some(x), Some(seed), Some(out)], f),
        Kernel::Flash(fl) | Kernel::FlashMerge(fl) => {
            // A paged K or V names the elements it reaches (one page's view, times the pool),
            // its table and its sizes.
            let reach = |x: &View, p: &Option<super::Paging>| p.as_ref().map(|p| p.reach(x));
            let (k, v) = (reach(&fl.k, &fl.k_paging), reach(&fl.v, &fl.v_paging));
            let (k, v) = (k.as_ref().unwrap_or(&fl.k), v.as_ref().unwrap_or(&fl.v));
            [&fl.q, k, v, &fl.out].into_iter().chain(&fl.extras).chain(&fl.lse).for_each(|v| f(Named::View(v)));
            for (x, p) in [(&fl.k, &fl.k_paging), (&fl.v, &fl.v_paging)] {
                if let Some(p) = p {
                    f(Named::View(&p.table));
                    x.shape.iter().chain(&x.strides).chain([&p.page, &p.pages, &p.stride]).for_each(|d| f(Named::Dim(d)));
                }
            }
            super::score_dims(fl).iter().for_each(|d| f(Named::Dim(d)));
        }
        Kernel::FlashBwd(b) | Kernel::FlashBwdReduce(b) => {
            let stats = b.lse.iter().flat_map(|(x, y)| [x, y]).chain(&b.delta).chain(&b.d_lse);
            let results = [&b.dq, &b.dq_accum, &b.dk, &b.dv].into_iter().flatten().chain(b.dx.iter().map(|(_, x)| x));
            [&b.q, &b.k, &b.v, &b.d_out].into_iter().chain(stats).chain(&b.extras).chain(results).for_each(|v| f(Named::View(v)));
            super::bwd_dims(b).iter().for_each(|d| f(Named::Dim(d)));
        }
    }
}
