//! Kernel formation (pass 2) of the attention ops: a flash op (with the log-sum-exp it also
//! writes) becomes a flash step and its merge step; the `flash_grad` nodes of one flash op
//! become one backward step (and the sum of its extra operands' gradients). Their score
//! analyses ([`FlashAnalysis`], [`BwdLinear`]) are made here, once for every backend.

use super::analysis::{BwdLinear, FlashAnalysis};
use super::form::{Formation, Place};
use super::policy::{CUDA_MAX_HEAD, Target};
use super::{BufferKind, Expr, FlashBwdKernel, FlashKernel, Fused, Kernel, Paging, ScheduleError, View};
use crate::ir::semantics::Class;
use crate::ir::{BinaryOp, DType, Dim, FlashSpec, FlashWrt, Op, Pair, ReduceOp, ScoreExpr, Value};

impl Formation<'_> {
    /// The first `n` operands of the flash-family node `v`, each dense along its last axis; the
    /// query's scale when pass 1 folded one into the op (the query is then read unscaled). K and
    /// V read in place from a paged cache add their [`Paging`] (by operand) to `pagings`.
    fn attention_operands(
        &mut self,
        v: Value,
        args: &[Value],
        n: usize,
        pagings: &mut Vec<(usize, Paging)>,
    ) -> Result<(Vec<View>, Option<ScoreExpr>), ScheduleError> {
        if args.len() < n {
            return Err(self.unsupported(v, format!("{} needs {n} operands", self.g.node(v).op.name())));
        }
        let mut views = Vec::with_capacity(n);
        let mut q_scale = None;
        for (k, a) in args[..n].iter().enumerate() {
            let a = match (k, self.placement.folded[a.index()].clone()) {
                (0, Some((x, c))) => {
                    q_scale = Some(c);
                    x
                }
                _ => *a,
            };
            views.push(match self.paged_operand(a) {
                Some((view, paging)) if k > 0 => {
                    pagings.push((k, paging));
                    view
                }
                _ => self.unit_last(v, a)?,
            });
        }
        Ok((views, q_scale))
    }

    /// Refuses head widths (of `q` and `v`) above what the CUDA kernels hold.
    fn cuda_head_fits(&self, v: Value, q: &View, vv: &View) -> Result<(), ScheduleError> {
        if self.policy.target() != Target::Cuda {
            return Ok(());
        }
        for x in [q, vv] {
            if let Some(c) = x.shape.last().and_then(Dim::as_const).filter(|c| *c > CUDA_MAX_HEAD) {
                return Err(self.unsupported(v, format!("head width {c} is above the {CUDA_MAX_HEAD} the CUDA kernels support")));
            }
        }
        Ok(())
    }

    /// Where flash op `v`'s result goes: a dense temporary, or, where its one user is an axis
    /// permutation that keeps the head axis last and is a result of the graph (transformers'
    /// `[B, S, H, D]` layout of `[B, H, S, D]` attention), a temporary laid out in that
    /// permutation's order. The permutation is then a dense view of it, which becomes the
    /// output buffer itself: the kernels write the result where it goes, with no copy after.
    fn flash_out(&mut self, v: Value, dtype: DType, shape: &[Dim]) -> View {
        let dense = self.temp(v, dtype, shape);
        let last = shape.len().saturating_sub(1);
        let outputs = self.g.outputs();
        let users = self.g.users(v);
        let perm = match (users.as_slice(), &self.g.node(v).op) {
            ([u], Op::Flash(_)) if outputs.iter().any(|(_, o)| o == u) && !outputs.iter().any(|(_, o)| *o == v) => {
                match &self.g.node(*u).op {
                    Op::Transpose { perm } if perm.len() == shape.len() && perm.last() == Some(&last) => perm.clone(),
                    _ => return dense,
                }
            }
            _ => return dense,
        };
        let permuted: Vec<Dim> = perm.iter().map(|&a| shape[a].clone()).collect();
        let mut strides = dense.strides.clone();
        for (k, stride) in perm.iter().zip(super::row_major(&permuted)) {
            strides[*k] = stride;
        }
        View { strides, ..dense }
    }

    /// The tile table and partial-state buffers of the step about to be added.
    fn step_tables(&mut self, v: Value) -> (usize, usize, usize) {
        let step = self.plan.steps.len();
        let tiles = self.buffer(BufferKind::TileTable { step }, DType::Bool, Dim::constant(0), v);
        let partials = self.buffer(BufferKind::Partials { step }, DType::F32, Dim::constant(0), v);
        (step, tiles, partials)
    }

    /// A flash step (and its merge step); `lse` names the `flash_lse` node it also writes.
    pub(super) fn flash(&mut self, v: Value, spec: &FlashSpec, args: &[Value], lse: Option<Value>) -> Result<View, ScheduleError> {
        let label = self.label(v);
        let ty = match &self.g.node(v).op {
            // A lone log-sum-exp: the flash op's result goes to a temporary nobody reads.
            Op::FlashLse(_) => {
                let operands: Vec<_> = self.g.operands(v).into_iter().map(|a| &self.g.node(a).ty).collect();
                crate::ir::infer(&Op::Flash(Box::new(spec.clone())), &operands, None).map_err(|e| self.unsupported(v, e))?
            }
            _ => self.g.node(v).ty.clone(),
        };
        let mut pagings = Vec::new();
        let (qkv, q_scale) = self.attention_operands(v, args, 3, &mut pagings)?;
        let paging = |k: usize| pagings.iter().find(|(a, _)| *a == k).map(|(_, p)| p.clone());
        let (k_paging, v_paging) = (paging(1), paging(2));
        let mut extras = Vec::new();
        for a in &args[3..] {
            extras.push(self.view(*a)?);
        }
        let [q, k, vv]: [View; 3] = qkv.try_into().map_err(|_| self.unsupported(v, "flash needs q, k and v"))?;
        let r = q.shape.len();
        if let Pair::Additive { weight } = spec.pair {
            let w = extras.get(weight).cloned().ok_or_else(|| self.unsupported(v, "the additive weight is not an operand"))?;
            // Dense along its last axis (the kernels read it as a vector), in its own type.
            let (last, dtype) = (w.shape.len().saturating_sub(1), w.dtype);
            extras[weight] = self.dense_if(v, w, dtype, |x| x.unit_stride(last));
        }
        self.cuda_head_fits(v, &q, &vv)?;
        let out = self.flash_out(v, ty.dtype, &ty.shape);
        let lse = match lse {
            Some(s) => {
                let view = self.temp(s, DType::F32, &ty.shape[..r - 1]);
                self.place[s.index()] = Some(Place::View(view.clone()));
                Some(view)
            }
            None => None,
        };
        let (step, tiles, partials) = self.step_tables(v);
        let variant = self.policy.flash_variant([q.dtype, k.dtype, vv.dtype], q.shape[r - 2].as_const(), spec.pair == Pair::Dot);
        let analysis = FlashAnalysis::of(spec, q_scale);
        let kernel = FlashKernel {
            spec: spec.clone(),
            q,
            k,
            v: vv,
            extras,
            out: out.clone(),
            lse,
            step,
            tiles,
            partials,
            variant,
            analysis,
            k_paging,
            v_paging,
        };
        self.step(Kernel::Flash(Box::new(kernel.clone())), label.clone(), v);
        self.step(Kernel::FlashMerge(Box::new(kernel)), format!("{label} (merge)"), v);
        Ok(out)
    }

    /// The step computing every gradient of the flash op whose `flash_grad` node `v` is one
    /// (each member placed at its result), and the merge of extra operands' gradients.
    pub(super) fn flash_grad(&mut self, v: Value) -> Result<View, ScheduleError> {
        let Op::FlashGrad { spec, lse_grad, .. } = self.g.node(v).op.clone() else {
            return Err(self.unsupported(v, "not a flash_grad node"));
        };
        let args = self.g.operands(v);
        let fixed = spec.grad_fixed_operands(lse_grad);
        if args.len() < fixed {
            return Err(self.unsupported(v, format!("flash_grad needs {fixed} operands before its extras")));
        }
        let mut pagings = Vec::new();
        let (dense, q_scale) = self.attention_operands(v, &args, 4, &mut pagings)?;
        if !pagings.is_empty() {
            return Err(self.unsupported(v, "a flash gradient reading a paged cache in place"));
        }
        let [q, k, vv, d_out]: [View; 4] = dense.try_into().map_err(|_| self.unsupported(v, "flash_grad needs q, k, v, d_out"))?;
        self.cuda_head_fits(v, &q, &vv)?;
        let lse = if fixed >= 6 {
            let a = self.view(args[4])?;
            let a = self.dense_if(v, a, DType::F32, View::is_contiguous);
            Some((a, self.unit_last(v, args[5])?))
        } else {
            None
        };
        let mut extras = Vec::new();
        for a in &args[fixed..] {
            extras.push(self.view(*a)?);
        }
        let classes: Vec<Class> = extras.iter().map(|x| Class::of(x.dtype)).collect();
        let grad =
            crate::ir::grad::score_grad(&spec, &|x| classes.get(x).copied().unwrap_or(Class::Float)).map_err(|e| self.unsupported(v, e))?;
        let results = self.gradient_results(v)?;
        let d_lse = match lse_grad {
            true => {
                let a = self.view(args[6])?;
                Some(self.dense_if(v, a, DType::F32, View::is_contiguous))
            }
            false => None,
        };
        let (delta, d_lse) = match &lse {
            Some((l, out)) if self.policy.flash_bwd_delta() => (Some(self.delta_rows(v, &d_out, out, l, d_lse)?), None),
            _ => (None, d_lse),
        };
        let wanted: Vec<usize> = results.dx.iter().map(|(n, _)| *n).collect();
        // Extra gradients scattered over their operand (a bias table by relative position):
        // the tensor-core kernel adds them atomically, so its deterministic mode leaves them to
        // the SIMT kernel; one sum per item (ALiBi's slopes) it adds in both modes.
        let scattered = grad.loads.iter().any(|l| wanted.contains(&l.input) && !super::item_level(l, spec.rank));
        let variant = self.policy.flash_bwd_variant([q.dtype, k.dtype, vv.dtype, d_out.dtype], spec.pair == Pair::Dot, scattered);
        let linear = BwdLinear::of(&spec, &grad, &wanted);
        let Results { dq, dq_scale, dk, dv, dx } = results;
        let (dq, dq_accum) = match dq {
            Some(dq) if self.policy.flash_bwd_atomic_dq(variant) => {
                let acc = self.temp(v, DType::F32, &dq.shape);
                let zero =
                    Kernel::Elementwise { out: acc.clone(), inputs: Vec::new(), expr: Expr::Const(0.0, DType::F32), more: Vec::new() };
                self.step(zero, format!("{} (dq zeroed)", self.label(v)), v);
                (None, Some((dq, acc)))
            }
            dq => (dq, None),
        };
        let (step, tiles, partials) = self.step_tables(v);
        let kernel = FlashBwdKernel {
            spec: *spec,
            q,
            q_scale,
            k,
            v: vv,
            d_out,
            lse,
            delta,
            d_lse,
            extras,
            dq,
            dq_scale,
            dq_accum: dq_accum.as_ref().map(|(_, acc)| acc.clone()),
            dk,
            dv,
            dx,
            grad,
            linear,
            step,
            tiles,
            partials,
            variant,
        };
        let label = self.label(v);
        let reduce = !kernel.dx.is_empty();
        self.step(Kernel::FlashBwd(Box::new(kernel.clone())), label.clone(), v);
        if reduce {
            self.step(Kernel::FlashBwdReduce(Box::new(kernel)), format!("{label} (extra gradients)"), v);
        }
        if let Some((dq, acc)) = dq_accum {
            let expr = Expr::Cast(Box::new(Expr::Load(0)), dq.dtype);
            self.step(Kernel::Elementwise { out: dq, inputs: vec![acc], expr, more: Vec::new() }, format!("{label} (dq rounded)"), v);
        }
        self.placed(v)
    }

    /// The step before flash backward `v` that sums each row's `delta = Σ d_out ∘ out` (in f32
    /// products, as the kernels form them) into a buffer of the log-sum-exp's layout `lse`, and
    /// with the log-sum-exp's cotangent `d_lse` (dense, that layout) one that subtracts it.
    fn delta_rows(&mut self, v: Value, d_out: &View, out: &View, lse: &View, d_lse: Option<View>) -> Result<View, ScheduleError> {
        let r = d_out.shape.len();
        let f32 = |x: Expr| Expr::Cast(Box::new(x), DType::F32);
        let expr = Expr::Binary(BinaryOp::Mul, Box::new(f32(Expr::Load(0))), Box::new(f32(Expr::Load(1))), DType::F32);
        let x = Fused { inputs: vec![d_out.clone(), out.clone()], expr, shape: d_out.shape.clone(), dtype: DType::F32 };
        let mut kept = d_out.shape.clone();
        kept[r - 1] = Dim::constant(1);
        let sums = self.temp(v, DType::F32, &kept);
        let delta = View::contiguous(sums.buf, DType::F32, d_out.shape[..r - 1].to_vec());
        if delta.strides != lse.strides {
            return Err(self.unsupported(v, "the rows' delta and log-sum-exp differ in layout"));
        }
        let label = format!("{} (delta)", self.label(v));
        self.step(Kernel::ReduceOf { x, op: ReduceOp::Sum, axes: vec![r - 1], out: sums }, label, v);
        let Some(d_lse) = d_lse else { return Ok(delta) };
        if d_lse.strides != lse.strides {
            return Err(self.unsupported(v, "the log-sum-exp and its cotangent differ in layout"));
        }
        let less = self.temp(v, DType::F32, &delta.shape);
        let expr = Expr::Binary(BinaryOp::Sub, Box::new(Expr::Load(0)), Box::new(Expr::Load(1)), DType::F32);
        let label = format!("{} (delta less d_lse)", self.label(v));
        self.step(Kernel::Elementwise { out: less.clone(), inputs: vec![delta, d_lse], expr, more: Vec::new() }, label, v);
        Ok(less)
    }

    /// A buffer for each gradient of the group of `flash_grad` node `v`, each member placed at
    /// its result: a query gradient that pass 1 found scaled is written as the last product of
    /// its scalings, which are placed there too.
    fn gradient_results(&mut self, v: Value) -> Result<Results, ScheduleError> {
        let members = self.placement.grads.get(&v).cloned().unwrap_or_else(|| vec![v]);
        let mut r = Results { dq: None, dq_scale: None, dk: None, dv: None, dx: Vec::new() };
        for m in &members {
            let Op::FlashGrad { wrt, .. } = &self.g.node(*m).op else { continue };
            let ty = self.g.node(*m).ty.clone();
            let chain = match self.placement.scaled.get(m) {
                Some((chain, c)) => {
                    r.dq_scale = Some(c.clone());
                    chain.clone()
                }
                None => Vec::new(),
            };
            let holder = chain.last().copied().unwrap_or(*m);
            let out = self.temp(holder, ty.dtype, &ty.shape);
            for x in std::iter::once(m).chain(&chain) {
                self.place[x.index()] = Some(Place::View(out.clone()));
            }
            match wrt {
                FlashWrt::Q => r.dq = Some(out),
                FlashWrt::K => r.dk = Some(out),
                FlashWrt::V => r.dv = Some(out),
                FlashWrt::Extra(n) => r.dx.push((*n, out)),
            }
        }
        Ok(r)
    }
}

/// The results of a flash backward step (see [`FlashBwdKernel`]).
struct Results {
    dq: Option<View>,
    dq_scale: Option<ScoreExpr>,
    dk: Option<View>,
    dv: Option<View>,
    dx: Vec<(usize, View)>,
}
