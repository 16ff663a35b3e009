//! kiln-compile
