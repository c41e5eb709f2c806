//! Poison-tolerant locking, the one helper every module uses.
//!
//! A panic while a guard is held poisons a `std::sync::Mutex`. The state behind this crate's
//! locks is updated whole (an entry inserted or removed, a counter moved) before any call that
//! could panic, so a later holder cannot misread it: the guard is taken back instead of
//! spreading the panic to every later caller.

use std::sync::{Mutex, MutexGuard};

/// Lock `m`, taking the guard back from a poisoned lock.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
