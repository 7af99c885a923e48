//! Lowering of checked `.attn` programs into the graph IR (being written).
