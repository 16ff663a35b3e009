//! kiln-nn
