//! kiln
