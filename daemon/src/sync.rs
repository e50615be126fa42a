//! Locks the daemons take the same way.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks `mutex`, going on past a poisoned lock. What the daemons guard with a
/// mutex (a ledger, counters, a connection's bookkeeping) is updated in steps that
/// leave it whole; a panic elsewhere while holding it must not take every later
/// request down with it, so the value is used as the panic left it.
pub fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poisoned_lock_still_gives_its_value() {
        let mutex = std::sync::Arc::new(Mutex::new(1));
        let held = std::sync::Arc::clone(&mutex);
        let _ = std::thread::spawn(move || {
            let _guard = held.lock();
            panic!("while holding it");
        })
        .join();
        assert!(mutex.is_poisoned());
        *lock(&mutex) += 1;
        assert_eq!(*lock(&mutex), 2);
    }
}
