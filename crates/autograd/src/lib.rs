//! kiln-autograd
