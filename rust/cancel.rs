//! A cancellation flag that blocking calls deep in the engine observe without being passed it: a
//! request to object storage waiting on a stalled store is abandoned the moment its flag is
//! raised (`store::block_on`), instead of after its timeouts and retries (minutes).
//!
//! Whoever can cancel (a copy's [`Progress`](crate::copy::Progress), a store call watched for
//! Ctrl-C by the bindings) runs the work with [`scoped`] on each thread that may block; the
//! flag is per thread, so concurrent loads do not cancel each other.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// A shared flag: raised once, read by every thread doing the work.
pub type Flag = Arc<AtomicBool>;

thread_local! {
    static CURRENT: RefCell<Option<Flag>> = const { RefCell::new(None) };
}

/// Runs `work` on this thread with `flag` as the flag [`current`] returns (none: `work` cannot
/// be cancelled this way); the previous one is restored after, also on a panic.
pub fn scoped<R>(flag: Option<&Flag>, work: impl FnOnce() -> R) -> R {
    struct Restore(Option<Flag>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let previous = self.0.take();
            CURRENT.with(|c| *c.borrow_mut() = previous);
        }
    }
    let previous = CURRENT.with(|c| std::mem::replace(&mut *c.borrow_mut(), flag.cloned()));
    let _restore = Restore(previous);
    work()
}

/// The flag of the work this thread runs, if any.
pub fn current() -> Option<Flag> {
    CURRENT.with(|c| c.borrow().clone())
}

/// Whether `flag` is raised.
pub fn raised(flag: &Flag) -> bool {
    flag.load(Ordering::Relaxed)
}

/// Raises `flag`.
pub fn raise(flag: &Flag) {
    flag.store(true, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flag_is_per_thread_and_restored_after_the_work() {
        let flag: Flag = Arc::default();
        assert!(current().is_none());
        scoped(Some(&flag), || {
            assert!(current().is_some_and(|f| Arc::ptr_eq(&f, &flag)));
            std::thread::spawn(|| assert!(current().is_none()))
                .join()
                .unwrap();
            scoped(None, || assert!(current().is_none()));
            assert!(current().is_some());
        });
        assert!(current().is_none());
    }
}
