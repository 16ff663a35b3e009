//! What `#[derive(Module)]` (`kiln-derive`) expands to calls: each field is visited through
//! `ModuleField` when its type has it (a tensor, a module, a training flag, and vectors,
//! arrays and options of them) and skipped when it has not (sizes, configs), which the
//! expansion tells apart at compile time by method resolution: `(&&Field(&x))` finds
//! `Visits` (implemented for `&Field<T: ModuleField>`) before `Ignores` (for any `Field<T>`).

use crate::module::{join, Module};
use kiln_tensor::Flag;
pub use kiln_tensor::{Result, Tensor};
use std::any::Any;
use std::cell::RefCell;

/// A part of a module: how it names its parameters and buffers and takes the training flag.
pub trait ModuleField {
    fn visit_field(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor));
    fn visit_field_buffers(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor));
    fn set_field_training(&self, training: bool);
    /// Calls `f` on the field's modules (each after its own submodules).
    fn visit_field_modules(&self, _prefix: &str, _f: &mut dyn FnMut(&str, &dyn Any)) {}
    /// Sets the field when it is the module's own training flag (a `Flag` named `training`
    /// or marked `#[module(training)]`); other flags (`checkpointing`) are left alone.
    fn set_field_flag(&self, _on: bool) {}
    /// Calls `f` on each tensor of the field, mutably (`Module::visit_mut`).
    fn visit_field_mut(&mut self, f: &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()>;
}

impl<M: Module + 'static> ModuleField for M {
    fn visit_field_mut(&mut self, f: &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()> {
        self.visit_mut(f)
    }
    fn visit_field(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        self.visit(prefix, f)
    }
    fn visit_field_buffers(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        self.visit_buffers(prefix, f)
    }
    fn set_field_training(&self, training: bool) {
        self.set_training(training)
    }
    fn visit_field_modules(&self, prefix: &str, f: &mut dyn FnMut(&str, &dyn Any)) {
        self.visit_modules(prefix, f);
        f(prefix, self);
    }
}

/// A tensor field is the parameter (or, marked `buffer`, the buffer) of its name.
impl ModuleField for Tensor {
    fn visit_field(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        f(prefix.to_string(), self)
    }
    fn visit_field_buffers(&self, _prefix: &str, _f: &mut dyn FnMut(String, &Tensor)) {}
    fn set_field_training(&self, _training: bool) {}
    fn visit_field_mut(&mut self, f: &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()> {
        f(self)
    }
}

/// A flag field named `training` is the module's training flag: `train()` and `eval()` set
/// it.
impl ModuleField for Flag {
    fn visit_field(&self, _prefix: &str, _f: &mut dyn FnMut(String, &Tensor)) {}
    fn visit_field_buffers(&self, _prefix: &str, _f: &mut dyn FnMut(String, &Tensor)) {}
    fn set_field_training(&self, _training: bool) {}
    fn set_field_flag(&self, on: bool) {
        self.set(on)
    }
    fn visit_field_mut(&mut self, _f: &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()> {
        Ok(())
    }
}

/// Items of a list or an array are named by position (`h.0`, `h.1`, ...), as
/// `nn.ModuleList`'s.
macro_rules! by_position {
    ($($t:ty $(, const $n:ident)?);*) => {$(
        impl<T: ModuleField $(, const $n: usize)?> ModuleField for $t {
            fn visit_field(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
                self.iter().enumerate().for_each(|(i, x)| x.visit_field(&join(prefix, &i.to_string()), f))
            }
            fn visit_field_buffers(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
                self.iter().enumerate().for_each(|(i, x)| x.visit_field_buffers(&join(prefix, &i.to_string()), f))
            }
            fn set_field_training(&self, training: bool) {
                self.iter().for_each(|x| x.set_field_training(training))
            }
            fn visit_field_modules(&self, prefix: &str, f: &mut dyn FnMut(&str, &dyn Any)) {
                self.iter().enumerate().for_each(|(i, x)| x.visit_field_modules(&join(prefix, &i.to_string()), f))
            }
            fn visit_field_mut(&mut self, f: &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()> {
                self.iter_mut().try_for_each(|x| x.visit_field_mut(f))
            }
        }
    )*};
}
by_position!(Vec<T>; [T; N], const N);

/// An absent optional part has no parameters (a bias-free layer's `bias: None`).
impl<T: ModuleField> ModuleField for Option<T> {
    fn visit_field(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        if let Some(x) = self {
            x.visit_field(prefix, f)
        }
    }
    fn visit_field_buffers(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        if let Some(x) = self {
            x.visit_field_buffers(prefix, f)
        }
    }
    fn set_field_training(&self, training: bool) {
        if let Some(x) = self {
            x.set_field_training(training)
        }
    }
    fn visit_field_modules(&self, prefix: &str, f: &mut dyn FnMut(&str, &dyn Any)) {
        if let Some(x) = self {
            x.visit_field_modules(prefix, f)
        }
    }
    fn visit_field_mut(&mut self, f: &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()> {
        self.as_mut().map_or(Ok(()), |x| x.visit_field_mut(f))
    }
}

/// A field as the expansion sees it.
pub struct Field<'a, T: ?Sized>(pub &'a T);

/// The calls on a field whose type is a `ModuleField`.
pub trait Visits {
    fn visit_field(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor));
    fn visit_field_buffers(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor));
    fn set_field_training(&self, training: bool);
    fn visit_field_modules(&self, prefix: &str, f: &mut dyn FnMut(&str, &dyn Any));
    fn set_field_flag(&self, on: bool);
}

impl<T: ModuleField> Visits for &Field<'_, T> {
    fn visit_field(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        self.0.visit_field(prefix, f)
    }
    fn visit_field_buffers(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        self.0.visit_field_buffers(prefix, f)
    }
    fn set_field_training(&self, training: bool) {
        self.0.set_field_training(training)
    }
    fn visit_field_modules(&self, prefix: &str, f: &mut dyn FnMut(&str, &dyn Any)) {
        self.0.visit_field_modules(prefix, f)
    }
    fn set_field_flag(&self, on: bool) {
        self.0.set_field_flag(on)
    }
}

/// The same calls on any other field: nothing to visit.
pub trait Ignores {
    fn visit_field(&self, _prefix: &str, _f: &mut dyn FnMut(String, &Tensor)) {}
    fn visit_field_buffers(&self, _prefix: &str, _f: &mut dyn FnMut(String, &Tensor)) {}
    fn set_field_training(&self, _training: bool) {}
    fn visit_field_modules(&self, _prefix: &str, _f: &mut dyn FnMut(&str, &dyn Any)) {}
    fn set_field_flag(&self, _on: bool) {}
}

impl<T: ?Sized> Ignores for Field<'_, T> {}

/// A field as the expansion's `visit_mut` sees it (the cell lets the shared-reference method
/// resolution above pick the trait).
pub struct FieldMut<'a, T: ?Sized>(pub RefCell<&'a mut T>);

/// `visit_mut` on a field whose type is a `ModuleField`.
pub trait VisitsMut {
    fn visit_field_mut(&self, f: &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()>;
}

impl<T: ModuleField> VisitsMut for &FieldMut<'_, T> {
    fn visit_field_mut(&self, f: &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()> {
        self.0.borrow_mut().visit_field_mut(f)
    }
}

/// `visit_mut` on any other field: nothing to visit.
pub trait IgnoresMut {
    fn visit_field_mut(&self, _f: &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()> {
        Ok(())
    }
}

impl<T: ?Sized> IgnoresMut for FieldMut<'_, T> {}
