//! Built-ins that make a tensor or widen one: `arange`, `stack` and `broadcast_to` (also
//! `expand`). Each is written with ops the IR already has (an iota; size-1 reshapes and a
//! concatenation; a select), so the interpreter, both backends and the derivative rules give
//! them their meaning with nothing new to keep in step.

use super::builtins::Call;
use super::{Cx, Frame, LResult, codes};
use crate::ir::{BinaryOp, DType, Dim, Op, TensorType, Value, broadcast_shapes};
use attn_dsl::Diagnostic;

impl Cx<'_, '_> {
    /// `arange(N)`, `stack([...], axis = a)`, `broadcast_to(x, [...])` / `expand(x, [...])`.
    pub(super) fn construct_builtin(&mut self, frame: &Frame, call: &Call<'_>) -> LResult<Option<Value>> {
        Ok(Some(match call.name {
            // 0, 1, ..., N - 1 as i32: the position along an axis of size N.
            "arange" => {
                self.arity(call, 1, 1, &[])?;
                let n = self.dim_expr(call.pos[0], &frame.dims)?;
                self.add(Op::Iota { axis: 0 }, Some(TensorType::new(DType::I32, vec![n])), &[], call.span)?
            }
            "stack" => self.stack(frame, call)?,
            "broadcast_to" | "expand" => self.broadcast_to(frame, call)?,
            _ => return Ok(None),
        }))
    }

    /// `stack([x1, ..., xn], axis = a)`: a new axis `a` of size n (of the result's axes; `-1`
    /// appends), each `xk` unsqueezed there, then concatenated along it.
    fn stack(&mut self, frame: &Frame, call: &Call<'_>) -> LResult<Value> {
        self.arity(call, 1, 1, &["axis"])?;
        let xs = self.tensor_list(frame, call, "stack([a, b], axis = -1)")?;
        let ty = self.ty(xs[0].0).clone();
        let widened = TensorType::new(ty.dtype, vec![Dim::constant(1); ty.rank() + 1]);
        let axis = match call.kw("axis") {
            Some(e) => self.axis(frame, e, &widened)?,
            None => 0,
        };
        let mut parts = Vec::new();
        for (x, span) in xs {
            let t = self.ty(x).clone();
            if t.rank() != ty.rank() {
                return Err(self.bad_args(call, &format!("stack needs tensors of one rank: {ty} and {t}")));
            }
            let mut shape = t.shape.clone();
            shape.insert(axis, Dim::constant(1));
            parts.push((self.add(Op::Reshape, Some(TensorType::new(t.dtype, shape)), &[(x, span)], span)?, span));
        }
        self.add(Op::Concat { axis }, None, &parts, call.span)
    }

    /// `broadcast_to(x, [d0, ...])`: `x` repeated along the target's axes as broadcasting does
    /// (`x`'s axes align to the right; each is equal to the target's or 1). Written as
    /// `where(p, x, x)` with an always-true `p` of the target's shape: exact for every value
    /// (`x + 0` would turn -0 into +0), and its derivative sums over the repeated axes.
    fn broadcast_to(&mut self, frame: &Frame, call: &Call<'_>) -> LResult<Value> {
        self.arity(call, 2, 2, &[])?;
        let x = self.tensor(frame, call.pos[0])?;
        let shape = self.shape_arg(frame, call, "`broadcast_to(x, [B, S, D])`")?;
        let ty = self.ty(x).clone();
        if broadcast_shapes(&ty.shape, &shape).as_ref() != Some(&shape) {
            let target = TensorType::new(ty.dtype, shape);
            return Err(self.error(
                Diagnostic::error(
                    codes::TYPE_MISMATCH,
                    format!("{ty} does not broadcast to {target}"),
                    call.pos[0].span,
                    format!("this is {ty}"),
                )
                .with_help("each axis of x (aligned to the right) must equal the target's or be 1"),
            ));
        }
        if shape == ty.shape {
            return Ok(x);
        }
        let span = call.span;
        let position = self.add(Op::Iota { axis: 0 }, Some(TensorType::new(DType::I32, shape)), &[], span)?;
        let zero = self.constant(0.0, DType::I32);
        let always = self.add(Op::Binary(BinaryOp::Ge), None, &[(position, span), (zero, span)], span)?;
        self.add(Op::Select, None, &[(always, span), (x, call.pos[0].span), (x, call.pos[0].span)], span)
    }
}
