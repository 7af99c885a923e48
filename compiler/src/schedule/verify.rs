//! The schedule's verifier: what each pass guarantees, checked after it, every finding reported
//! at once (as Cranelift's verifier does). [`super::schedule()`] runs it between the passes, so a
//! broken invariant fails where it was introduced, not later inside a kernel.
//!
//! - After kernel formation ([`formed`]): every buffer a step or the schedule names exists and
//!   has the kind its role needs (parameters, outputs, a flash step's tile table and partial
//!   states, the fault record); a flash step knows its own index; every checked index names a
//!   site; and every view lies inside its buffer at sample sizes (all dims 1, 2, distinct
//!   primes, and large), wherever the schedule's slice checks accept the sizes.
//! - After liveness ([`live`]): each step's reads and writes are exactly the buffers its kernel
//!   touches; every buffer a step reads is written by an earlier step, or provided by the run
//!   (inputs, tile tables, partial states, the fault record); every output is written.
//! - After the integer table ([`tables`]): each step counts its work items in its own
//!   `Items` slot; every tuning value the target's kernel reads has a slot; every dim a renderer
//!   reads has a slot; no integer has two.

use super::ints::{Named, table_dims, visit_kernel};
use super::liveness::touches;
use super::policy::Policy;
use super::{BufferKind, Expr, IntValue, Kernel, Schedule, Tuning, View};
use crate::ir::Dim;
use std::collections::HashMap;
use thiserror::Error;

/// A broken invariant of a schedule: which, and where.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum VerifyError {
    /// A step or the schedule names a buffer that does not exist.
    #[error("{what} names buffer b{buffer}, which does not exist")]
    NoSuchBuffer {
        /// Who names it.
        what: String,
        /// The buffer.
        buffer: usize,
    },
    /// A buffer in a role its kind does not fit.
    #[error("{what} is buffer b{buffer}, whose kind is {kind}")]
    BufferKind {
        /// The role (`parameter 0`, `the tile table of step 3`, ...).
        what: String,
        /// The buffer.
        buffer: usize,
        /// Its kind.
        kind: String,
    },
    /// A view reaching outside its buffer.
    #[error("{what}: a view of b{buffer} reaches elements {lo}..={hi} of {elems} at {sizes}")]
    ViewOutOfBounds {
        /// The step.
        what: String,
        /// The buffer.
        buffer: usize,
        /// The lowest element it reaches.
        lo: i64,
        /// The highest.
        hi: i64,
        /// The buffer's element count.
        elems: i64,
        /// The sample sizes.
        sizes: String,
    },
    /// A flash step that does not know its own index.
    #[error("{what} says it is step {says}")]
    StepIndex {
        /// The step.
        what: String,
        /// The index its kernel holds.
        says: usize,
    },
    /// A checked index naming no site, or sites without a fault record.
    #[error("{what} reports index faults as site {site}, but the schedule has {sites} sites and {}", if *.fault { "a fault record" } else { "no fault record" })]
    Site {
        /// The step.
        what: String,
        /// The site it names.
        site: usize,
        /// How many there are.
        sites: usize,
        /// Whether there is a fault record.
        fault: bool,
    },
    /// Reads or writes that are not the buffers the kernel touches.
    #[error("{what} lists reads {reads:?} and writes {writes:?}, but its kernel touches {touched:?}")]
    Touches {
        /// The step.
        what: String,
        /// The reads it lists.
        reads: Vec<usize>,
        /// The writes it lists.
        writes: Vec<usize>,
        /// What its kernel reads and writes.
        touched: (Vec<usize>, Vec<usize>),
    },
    /// A buffer read before any step writes it.
    #[error("{what} reads b{buffer} before any step writes it")]
    ReadBeforeWrite {
        /// The step.
        what: String,
        /// The buffer.
        buffer: usize,
    },
    /// An output no step writes.
    #[error("output {output} (b{buffer}) is written by no step")]
    OutputUnwritten {
        /// The output.
        output: usize,
        /// Its buffer.
        buffer: usize,
    },
    /// A step whose work slot is not its own `Items` value.
    #[error("{what} counts its work items in ints[{slot}], which holds {holds}")]
    WorkSlot {
        /// The step.
        what: String,
        /// The slot.
        slot: usize,
        /// What the slot holds.
        holds: String,
    },
    /// A value the integer table lacks.
    #[error("{what} reads {value}, which the integer table lacks")]
    MissingInt {
        /// Who reads it.
        what: String,
        /// The value.
        value: String,
    },
    /// A value the integer table holds twice.
    #[error("the integer table holds {value} twice (ints[{first}] and ints[{second}])")]
    DuplicateInt {
        /// The value.
        value: String,
        /// Its first slot.
        first: usize,
        /// Its second.
        second: usize,
    },
}

/// Every invariant of a finished schedule for `policy`'s target (all three passes').
pub fn verify(plan: &Schedule, policy: &Policy) -> Result<(), Vec<VerifyError>> {
    let mut errors = formed(plan).err().unwrap_or_default();
    errors.extend(live(plan).err().unwrap_or_default());
    errors.extend(tables(plan, policy).err().unwrap_or_default());
    if errors.is_empty() { Ok(()) } else { Err(errors) }
}

/// `errors`, as a result.
fn found(errors: Vec<VerifyError>) -> Result<(), Vec<VerifyError>> {
    if errors.is_empty() { Ok(()) } else { Err(errors) }
}

/// A step as messages name it.
fn step_name(plan: &Schedule, s: usize) -> String {
    format!("step {s} ({})", plan.steps[s].label)
}

/// What kernel formation guarantees.
pub(super) fn formed(plan: &Schedule) -> Result<(), Vec<VerifyError>> {
    let mut errors = Vec::new();
    let kind = |errors: &mut Vec<VerifyError>, what: String, buffer: usize, ok: &dyn Fn(&BufferKind) -> bool| match plan.buffers.get(buffer)
    {
        None => errors.push(VerifyError::NoSuchBuffer { what, buffer }),
        Some(b) if !ok(&b.kind) => errors.push(VerifyError::BufferKind { what, buffer, kind: format!("{:?}", b.kind) }),
        Some(_) => {}
    };
    for (i, b) in plan.params.iter().enumerate() {
        kind(&mut errors, format!("parameter {i}"), *b, &|k| *k == BufferKind::Param(i));
    }
    for (i, b) in plan.outputs.iter().enumerate() {
        kind(&mut errors, format!("output {i}"), *b, &|k| *k == BufferKind::Output(i));
    }
    if let Some(b) = plan.fault {
        kind(&mut errors, "the fault record".into(), b, &|k| *k == BufferKind::Fault);
    }
    for (s, step) in plan.steps.iter().enumerate() {
        let (own, tiles, partials) = match &step.kernel {
            Kernel::Flash(f) | Kernel::FlashMerge(f) => (f.step, f.tiles, f.partials),
            Kernel::FlashBwd(f) | Kernel::FlashBwdReduce(f) => (f.step, f.tiles, f.partials),
            _ => continue,
        };
        kind(&mut errors, format!("the tile table of {}", step_name(plan, s)), tiles, &|k| *k == BufferKind::TileTable { step: own });
        kind(&mut errors, format!("the partial states of {}", step_name(plan, s)), partials, &|k| *k == BufferKind::Partials { step: own });
        // The merge and the extra-gradient sum follow their step.
        let expected = if matches!(step.kernel, Kernel::FlashMerge(_) | Kernel::FlashBwdReduce(_)) { s.checked_sub(1) } else { Some(s) };
        if expected != Some(own) {
            errors.push(VerifyError::StepIndex { what: step_name(plan, s), says: own });
        }
    }
    errors.extend(sites(plan));
    errors.extend(bounds(plan));
    found(errors)
}

/// Checked indices name sites of the schedule, which then has a fault record.
fn sites(plan: &Schedule) -> Vec<VerifyError> {
    let mut errors = Vec::new();
    for (s, step) in plan.steps.iter().enumerate() {
        let mut named = Vec::new();
        let mut gathers = |e: &Expr| {
            e.visit(&mut |x| {
                if let Expr::Gather(_, _, _, site) = x {
                    named.push(*site);
                }
            })
        };
        match &step.kernel {
            Kernel::Elementwise { expr, more, .. } => std::iter::once(expr).chain(more.iter().map(|(_, e)| e)).for_each(&mut gathers),
            Kernel::ReduceOf { x, .. } => gathers(&x.expr),
            Kernel::ScatterAdd { site, .. } => named.push(*site),
            _ => {}
        }
        for site in named {
            if site >= plan.sites.len() || plan.fault.is_none() {
                errors.push(VerifyError::Site { what: step_name(plan, s), site, sites: plan.sites.len(), fault: plan.fault.is_some() });
            }
        }
    }
    errors
}

/// Every view lies inside its buffer at every sample of sizes the slice checks accept.
fn bounds(plan: &Schedule) -> Vec<VerifyError> {
    let mut errors = Vec::new();
    let mut symbols: Vec<String> = plan.buffers.iter().flat_map(|b| b.elems.symbols()).collect();
    for step in &plan.steps {
        visit_kernel(&step.kernel, &mut |x| {
            if let Named::View(v) = x {
                symbols.extend(std::iter::once(&v.offset).chain(&v.shape).chain(&v.strides).flat_map(Dim::symbols));
            }
        });
    }
    symbols.sort();
    symbols.dedup();
    for env in sample_sizes(&symbols) {
        if !accepted(plan, &env) {
            continue;
        }
        for (s, step) in plan.steps.iter().enumerate() {
            visit_kernel(&step.kernel, &mut |x| {
                let Named::View(v) = x else { return };
                match plan.buffers.get(v.buf) {
                    None => errors.push(VerifyError::NoSuchBuffer { what: step_name(plan, s), buffer: v.buf }),
                    Some(b) => {
                        if let (Some((lo, hi)), Ok(elems)) = (reach(v, &env), b.elems.eval(&env))
                            && (lo < 0 || hi >= elems)
                        {
                            let mut sizes: Vec<String> = env.iter().map(|(k, v)| format!("{k}={v}")).collect();
                            sizes.sort();
                            errors.push(VerifyError::ViewOutOfBounds {
                                what: step_name(plan, s),
                                buffer: v.buf,
                                lo,
                                hi,
                                elems,
                                sizes: sizes.join(" "),
                            });
                        }
                    }
                }
            });
        }
        if !errors.is_empty() {
            break;
        }
    }
    errors.dedup();
    errors
}

/// The sample sizes bounds are checked at: every symbol 1, every symbol 2, distinct small
/// primes, and those primes plus 64 (past every constant slice bound the examples use).
fn sample_sizes(symbols: &[String]) -> Vec<HashMap<String, i64>> {
    const PRIMES: [i64; 12] = [3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41];
    let with = |f: &dyn Fn(usize) -> i64| symbols.iter().enumerate().map(|(n, s)| (s.clone(), f(n))).collect();
    let prime = |n: usize| PRIMES[n % PRIMES.len()] + 41 * (n / PRIMES.len()) as i64;
    vec![with(&|_| 1), with(&|_| 2), with(&prime), with(&|n| prime(n) + 64)]
}

/// Whether a run at `env` gets past the schedule's own checks: sizes not negative, slices
/// inside their axes.
fn accepted(plan: &Schedule, env: &HashMap<String, i64>) -> bool {
    let ok = |d: &Dim| d.eval(env).is_ok_and(|v| v >= 0);
    plan.buffers.iter().all(|b| ok(&b.elems))
        && plan
            .checks
            .iter()
            .all(|c| matches!((c.start.eval(env), c.end.eval(env), c.size.eval(env)), (Ok(a), Ok(b), Ok(n)) if 0 <= a && a <= b && b <= n))
}

/// The lowest and highest element a view reaches at `env`; `None` when it is empty or a size
/// does not evaluate.
fn reach(v: &View, env: &HashMap<String, i64>) -> Option<(i64, i64)> {
    let (mut lo, mut hi) = (v.offset.eval(env).ok()?, v.offset.eval(env).ok()?);
    for (n, st) in v.shape.iter().zip(&v.strides) {
        let (n, st) = (n.eval(env).ok()?, st.eval(env).ok()?);
        if n <= 0 {
            return None;
        }
        let span = (n - 1).checked_mul(st)?;
        if span < 0 { lo = lo.checked_add(span)? } else { hi = hi.checked_add(span)? }
    }
    Some((lo, hi))
}

/// What liveness guarantees.
pub(super) fn live(plan: &Schedule) -> Result<(), Vec<VerifyError>> {
    let mut errors = Vec::new();
    let mut written: Vec<bool> = plan
        .buffers
        .iter()
        .map(|b| matches!(b.kind, BufferKind::Param(_) | BufferKind::TileTable { .. } | BufferKind::Partials { .. } | BufferKind::Fault))
        .collect();
    for (s, step) in plan.steps.iter().enumerate() {
        let touched = touches(&step.kernel);
        if (&step.reads, &step.writes) != (&touched.0, &touched.1) {
            errors.push(VerifyError::Touches { what: step_name(plan, s), reads: step.reads.clone(), writes: step.writes.clone(), touched });
        }
        for b in &step.reads {
            if !written.get(*b).copied().unwrap_or(false) {
                errors.push(VerifyError::ReadBeforeWrite { what: step_name(plan, s), buffer: *b });
            }
        }
        for b in &step.writes {
            if let Some(w) = written.get_mut(*b) {
                *w = true;
            }
        }
    }
    for (output, buffer) in plan.outputs.iter().enumerate() {
        if !written.get(*buffer).copied().unwrap_or(false) {
            errors.push(VerifyError::OutputUnwritten { output, buffer: *buffer });
        }
    }
    found(errors)
}

/// What the integer table guarantees.
pub(super) fn tables(plan: &Schedule, policy: &Policy) -> Result<(), Vec<VerifyError>> {
    let mut errors = Vec::new();
    // Each integer's first slot (linear in the table, whatever its length).
    let mut slots: HashMap<&IntValue, usize> = HashMap::with_capacity(plan.ints.len());
    for (second, v) in plan.ints.iter().enumerate() {
        if let Some(first) = slots.insert(v, second) {
            slots.insert(v, first);
            errors.push(VerifyError::DuplicateInt { value: format!("{v:?}"), first, second });
        }
    }
    for (s, step) in plan.steps.iter().enumerate() {
        let items = IntValue::Tuning { step: s, param: Tuning::Items };
        match plan.ints.get(step.work) {
            Some(v) if *v == items => {}
            other => errors.push(VerifyError::WorkSlot {
                what: step_name(plan, s),
                slot: step.work,
                holds: other.map_or("nothing".to_string(), |v| format!("{v:?}")),
            }),
        }
        for param in policy.tunings(&step.kernel) {
            if !slots.contains_key(&IntValue::Tuning { step: s, param }) {
                errors.push(VerifyError::MissingInt { what: step_name(plan, s), value: format!("tuning value {param:?}") });
            }
        }
    }
    for d in table_dims(plan) {
        let symbols: Vec<Dim> = d.symbols().iter().map(|s| Dim::sym(s)).collect();
        for d in std::iter::once(d).chain(symbols) {
            if !slots.contains_key(&IntValue::Dim(d.clone())) {
                errors.push(VerifyError::MissingInt { what: "a view or an expression".into(), value: format!("dim `{d}`") });
            }
        }
    }
    errors.dedup();
    found(errors)
}
