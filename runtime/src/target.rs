//! Where a program runs. Only the reference interpreter exists so far; the names of the planned
//! targets are reserved so that asking for one gives a clear "not built yet" error rather than
//! "unknown target", and so that adding one is a new variant plus a match arm in
//! [`Program::run`](crate::Program::run).

use std::fmt;
use std::str::FromStr;
use thiserror::Error;

/// A target that can run programs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Target {
    /// The reference interpreter (exact semantics, slow).
    #[default]
    Interp,
}

/// Every target name the command line knows, built or planned.
pub const TARGET_NAMES: &[&str] = &["interp", "cpu", "cuda"];

impl Target {
    /// The target's name, as given to `--target`.
    pub fn name(self) -> &'static str {
        match self {
            Target::Interp => "interp",
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
    /// A planned target that this build does not have yet.
    #[error("target `{0}` is not available: it is not built yet (available: interp)")]
    Unavailable(String),
    /// A name that is no target at all.
    #[error("unknown target `{0}` (known: {known})", known = TARGET_NAMES.join(", "))]
    Unknown(String),
}

impl FromStr for Target {
    type Err = TargetError;

    /// `interp`; `cpu` and `cuda` are [`TargetError::Unavailable`] until their backends exist.
    fn from_str(s: &str) -> Result<Target, TargetError> {
        match s {
            "interp" => Ok(Target::Interp),
            "cpu" | "cuda" => Err(TargetError::Unavailable(s.to_string())),
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
        assert_eq!("cuda".parse::<Target>(), Err(TargetError::Unavailable("cuda".into())));
        assert_eq!("cpu".parse::<Target>(), Err(TargetError::Unavailable("cpu".into())));
        assert!(matches!("tpu".parse::<Target>(), Err(TargetError::Unknown(_))));
        assert!("cuda".parse::<Target>().unwrap_err().to_string().contains("not built yet"));
        assert_eq!(Target::default().to_string(), "interp");
    }
}
