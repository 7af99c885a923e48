//! Where a program runs: native code on the CPU (the default), an NVIDIA GPU, or the reference
//! interpreter. Adding a target is a new variant plus a match arm in
//! [`Program::run`](crate::Program::run).

use std::fmt;
use std::str::FromStr;
use thiserror::Error;

/// A target that can run programs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Target {
    /// The reference interpreter (exact semantics, slow).
    Interp,
    /// Native code through Cranelift, multi-threaded ([`crate::cpu`]).
    #[default]
    Cpu,
    /// CUDA kernels compiled with NVRTC for the GPU ([`crate::cuda`]); needs a driver, a
    /// device (sm_80 or newer) and NVRTC at run time, else runs fail with
    /// [`crate::cuda::CudaError::Unavailable`].
    Cuda,
}

/// Every target name the command line knows, built or planned.
pub const TARGET_NAMES: &[&str] = &["interp", "cpu", "cuda"];

impl Target {
    /// The target's name, as given to `--target`.
    pub fn name(self) -> &'static str {
        match self {
            Target::Interp => "interp",
            Target::Cpu => "cpu",
            Target::Cuda => "cuda",
        }
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A target name that cannot be used.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum TargetError {
    /// A planned target that this build does not have (every known name is built today).
    #[error("target `{0}` is not available in this build (available: interp, cpu, cuda)")]
    Unavailable(String),
    /// A name that is no target at all.
    #[error("unknown target `{0}` (known: {known})", known = TARGET_NAMES.join(", "))]
    Unknown(String),
}

impl FromStr for Target {
    type Err = TargetError;

    /// `interp`, `cpu` or `cuda` (whether a GPU is present is checked when running).
    fn from_str(s: &str) -> Result<Target, TargetError> {
        match s {
            "interp" => Ok(Target::Interp),
            "cpu" => Ok(Target::Cpu),
            "cuda" => Ok(Target::Cuda),
            _ => Err(TargetError::Unknown(s.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_names() {
        assert_eq!("interp".parse::<Target>(), Ok(Target::Interp));
        assert_eq!("cuda".parse::<Target>(), Ok(Target::Cuda));
        assert_eq!("cpu".parse::<Target>(), Ok(Target::Cpu));
        assert!(matches!("tpu".parse::<Target>(), Err(TargetError::Unknown(_))));
        assert_eq!(Target::default().to_string(), "cpu");
    }
}
