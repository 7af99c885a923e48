//! The renderers. Each turns a [`crate::schedule::Schedule`] for its target into code, and
//! decides nothing the schedule has not decided; neither knows the other, and neither does IO:
//! [`clif`] renders a CPU schedule as Cranelift IR (one function per step, calling the runtime's
//! microkernels); [`cuda`] renders a CUDA schedule as one CUDA C++ translation unit with its
//! launches.

pub mod clif;
pub mod cuda;
