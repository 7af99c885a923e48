//! Code generators. Each backend turns a verified graph into something a runtime executes,
//! without doing any IO itself: [`clif`] builds Cranelift IR and an execution plan for the CPU;
//! [`cuda`] emits CUDA C++ source and the launch plan for NVIDIA GPUs.

pub mod clif;
pub mod cuda;
