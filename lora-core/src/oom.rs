//! Out-of-memory errors that tch reports as panics, turned back into errors.
//!
//! tch 0.26's `f_*` functions return libtorch errors as `Result`s, except in one case: when an
//! op that takes a `Scalar` argument (`f_add_scalar`, `f_mul_scalar`, `f_clamp`, `f_pow_tensor_scalar`,
//! …) fails, the `Scalar`'s `Drop` (tch `src/wrappers/scalar.rs`) reads libtorch's pending error
//! first and unwraps it — a panic whose message carries the original error. An allocation
//! failure inside such an op would therefore abort a run instead of reaching the out-of-memory
//! back-off. [`catch_oom`] runs a closure, and converts exactly those panics (messages that report
//! an allocation failure) back into a [`tch::TchError`]; every other panic keeps unwinding.
//!
//! While a closure runs under [`catch_oom`], the panic hook stays quiet for out-of-memory panics
//! on that thread (the default hook would print a backtrace for an error that is handled).

use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::Once;

thread_local! {
    static GUARDED: Cell<u32> = const { Cell::new(0) };
}

static HOOK: Once = Once::new();

/// True when a libtorch error message reports an allocation failure: CUDA
/// ("CUDA out of memory", "out of memory") or CPU ("DefaultCPUAllocator: can't allocate memory").
pub fn is_oom_message(msg: &str) -> bool {
    msg.contains("out of memory") || msg.contains("can't allocate memory")
}

fn payload_text(p: &(dyn std::any::Any + Send)) -> Option<String> {
    if let Some(s) = p.downcast_ref::<String>() {
        Some(s.clone())
    } else {
        p.downcast_ref::<&str>().map(|s| (*s).to_string())
    }
}

fn install_hook() {
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let quiet = GUARDED.with(|g| g.get() > 0)
                && payload_text(info.payload()).is_some_and(|m| is_oom_message(&m));
            if !quiet {
                previous(info);
            }
        }));
    });
}

struct Scope;

impl Scope {
    fn enter() -> Scope {
        GUARDED.with(|g| g.set(g.get() + 1));
        Scope
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        GUARDED.with(|g| g.set(g.get().saturating_sub(1)));
    }
}

/// Runs `f`; an out-of-memory panic raised inside it (see the module docs) comes back as
/// `Err(TchError::Torch(message).into())`. Tensors owned by `f` are dropped while unwinding, so
/// the memory of the failed attempt is free when this returns. Other panics are re-raised.
///
/// # Errors
/// Whatever `f` returns, plus converted out-of-memory panics.
pub fn catch_oom<T, E: From<tch::TchError>>(f: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
    install_hook();
    let scope = Scope::enter();
    let r = catch_unwind(AssertUnwindSafe(f));
    drop(scope);
    match r {
        Ok(v) => v,
        Err(payload) => match payload_text(payload.as_ref()) {
            Some(msg) if is_oom_message(&msg) => Err(E::from(tch::TchError::Torch(
                msg.trim_start_matches("called `Result::unwrap()` on an `Err` value: ")
                    .to_string(),
            ))),
            _ => resume_unwind(payload),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_oom_panics_keep_unwinding_and_values_pass_through() {
        let ok: Result<i32, tch::TchError> = catch_oom(|| Ok(3));
        assert_eq!(ok.unwrap(), 3);
        let r = std::panic::catch_unwind(|| {
            let _: Result<(), tch::TchError> = catch_oom(|| panic!("index out of range"));
        });
        assert!(r.is_err());
        let e: Result<(), tch::TchError> =
            catch_oom(|| panic!("CUDA out of memory. Tried to allocate 2.00 GiB"));
        assert!(e.unwrap_err().to_string().contains("CUDA out of memory"));
    }
}
