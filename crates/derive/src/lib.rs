//! `#[derive(Module)]`: a struct's `kiln::nn::Module` implementation from its fields, as
//! PyTorch registers a module's attributes.
//!
//! Every field is visited under its name (a tuple struct's by position): a `Tensor` is a
//! parameter, a module its subtree (`h.0.attn.c_attn.weight` through a `Vec`), an `Option`
//! what it holds. A `Flag` named `training` is the module's training flag (`train()` and
//! `eval()` set it; other flags are left alone). Fields of any other type (sizes, configs)
//! are left alone. Attributes:
//! - `#[module(buffer)]`: a tensor saved in the state dict but not trained (`named_buffers`);
//! - `#[module(skip)]`: not named (a tensor shared with another field, or tables kept out of
//!   the state dict, as PyTorch's non-persistent buffers); `to_device` still moves it;
//! - `#[module(rename = "name")]`: visited under another name (PyTorch's, for checkpoints);
//! - `#[module(flatten)]`: a child's parameters named as the parent's own;
//! - `#[module(training)]`: a `Flag` of another name that is the training flag.
//!
//! On the struct, `#[module(crate = "path")]` names where `Module` lives when it is not
//! `::kiln::nn` (Kiln's own crates).

use proc_macro::TokenStream;
use proc_macro2::TokenStream as Tokens;
use quote::quote;
use syn::{parse_macro_input, Data, DeriveInput, Fields, LitStr};

#[proc_macro_derive(Module, attributes(module))]
pub fn derive_module(input: TokenStream) -> TokenStream {
    let input = parse_macro_input!(input as DeriveInput);
    expand(&input).unwrap_or_else(|e| e.to_compile_error()).into()
}

/// How one field is visited.
#[derive(Default)]
struct FieldOpts {
    skip: bool,
    buffer: bool,
    flatten: bool,
    rename: Option<String>,
    training: bool,
}

fn field_opts(attrs: &[syn::Attribute]) -> syn::Result<FieldOpts> {
    let mut o = FieldOpts::default();
    for attr in attrs.iter().filter(|a| a.path().is_ident("module")) {
        attr.parse_nested_meta(|m| {
            if m.path.is_ident("skip") {
                o.skip = true;
            } else if m.path.is_ident("buffer") {
                o.buffer = true;
            } else if m.path.is_ident("flatten") {
                o.flatten = true;
            } else if m.path.is_ident("training") {
                o.training = true;
            } else if m.path.is_ident("rename") {
                o.rename = Some(m.value()?.parse::<LitStr>()?.value());
            } else {
                return Err(m.error("expected `skip`, `buffer`, `flatten`, `training` or `rename = \"name\"`"));
            }
            Ok(())
        })?;
    }
    Ok(o)
}

fn crate_path(attrs: &[syn::Attribute]) -> syn::Result<syn::Path> {
    let mut path: syn::Path = syn::parse_quote!(::kiln::nn);
    for attr in attrs.iter().filter(|a| a.path().is_ident("module")) {
        attr.parse_nested_meta(|m| {
            if m.path.is_ident("crate") {
                path = m.value()?.parse::<LitStr>()?.parse()?;
                Ok(())
            } else {
                Err(m.error("expected `crate = \"path\"` on the struct"))
            }
        })?;
    }
    Ok(path)
}

fn expand(input: &DeriveInput) -> syn::Result<Tokens> {
    let path = crate_path(&input.attrs)?;
    let Data::Struct(data) = &input.data else {
        return Err(syn::Error::new_spanned(&input.ident, "#[derive(Module)] takes a struct"));
    };
    let fields: Vec<(String, Tokens, FieldOpts)> = match &data.fields {
        Fields::Named(named) => named
            .named
            .iter()
            .map(|f| {
                let id = f.ident.as_ref().ok_or_else(|| syn::Error::new_spanned(f, "a named field without a name"))?;
                Ok((id.to_string().trim_start_matches("r#").to_string(), quote!(self.#id), field_opts(&f.attrs)?))
            })
            .collect::<syn::Result<_>>()?,
        Fields::Unnamed(unnamed) => unnamed
            .unnamed
            .iter()
            .enumerate()
            .map(|(i, f)| {
                let index = syn::Index::from(i);
                Ok((i.to_string(), quote!(self.#index), field_opts(&f.attrs)?))
            })
            .collect::<syn::Result<_>>()?,
        Fields::Unit => Vec::new(),
    };
    let (mut params, mut buffers, mut training, mut modules) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    // `visit_mut` (moving the module) reaches every field, skipped ones too.
    let tensors: Vec<Tokens> = fields
        .iter()
        .map(|(_, access, _)| quote!((&&#path::derive_support::FieldMut(::std::cell::RefCell::new(&mut #access))).visit_field_mut(f)?;))
        .collect();
    for (field_name, access, o) in fields.iter().filter(|f| !f.2.skip) {
        let name = o.rename.clone().unwrap_or_else(|| field_name.clone());
        let prefix = if o.flatten { quote!(prefix) } else { quote!(&#path::join(prefix, #name)) };
        let field = quote!((&&#path::derive_support::Field(&#access)));
        if o.buffer {
            buffers.push(quote!(#field.visit_field(#prefix, f);));
        } else {
            params.push(quote!(#field.visit_field(#prefix, f);));
            buffers.push(quote!(#field.visit_field_buffers(#prefix, f);));
            modules.push(quote!(#field.visit_field_modules(#prefix, f);));
        }
        training.push(quote!(#field.set_field_training(training);));
        if o.training || field_name == "training" {
            training.push(quote!(#field.set_field_flag(training);));
        }
    }
    let name = &input.ident;
    let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();
    Ok(quote! {
        impl #impl_generics #path::Module for #name #ty_generics #where_clause {
            #[allow(unused_variables)]
            fn visit(&self, prefix: &str, f: &mut dyn FnMut(String, &#path::derive_support::Tensor)) {
                use #path::derive_support::{Ignores as _, Visits as _};
                #(#params)*
            }
            #[allow(unused_variables)]
            fn visit_buffers(&self, prefix: &str, f: &mut dyn FnMut(String, &#path::derive_support::Tensor)) {
                use #path::derive_support::{Ignores as _, Visits as _};
                #(#buffers)*
            }
            #[allow(unused_variables)]
            fn visit_modules(&self, prefix: &str, f: &mut dyn FnMut(&str, &dyn ::std::any::Any)) {
                use #path::derive_support::{Ignores as _, Visits as _};
                #(#modules)*
            }
            #[allow(unused_variables)]
            fn visit_mut(
                &mut self,
                f: &mut dyn FnMut(&mut #path::derive_support::Tensor) -> #path::derive_support::Result<()>,
            ) -> #path::derive_support::Result<()> {
                use #path::derive_support::{IgnoresMut as _, VisitsMut as _};
                #(#tensors)*
                Ok(())
            }
            #[allow(unused_variables)]
            fn set_training(&self, training: bool) {
                use #path::derive_support::{Ignores as _, Visits as _};
                #(#training)*
            }
        }
    })
}
