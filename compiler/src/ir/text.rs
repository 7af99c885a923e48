//! Canonical text form of the IR (being written).
