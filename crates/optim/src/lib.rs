//! kiln-optim
