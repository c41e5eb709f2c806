//! The worker's use of glibc malloc (a no-op on other allocators and platforms): at most two
//! arenas, and free memory handed back to the kernel whenever the worker goes idle.
//!
//! glibc keeps what a process frees in its arenas, so a worker's RSS only ratchets up: a query
//! that freed its hash tables leaves them resident, and the next one's allocations, fragmented
//! differently, land beside them. TPC-H SF1 at a 64 MiB budget, one query per cluster: the
//! largest query (Q18, Q21) peaks at ~245 MiB per worker; the 22 queries in a row on one
//! cluster peaked at 278-334 MiB. [`trim_when_idle`] calls `malloc_trim` once no task has
//! been running for [`IDLE_FOR`].

use crate::admission::Admission;
use std::sync::Arc;
use std::time::Duration;

/// How long a worker has had no task running before its free memory is handed back.
pub const IDLE_FOR: Duration = Duration::from_millis(100);

/// Cap glibc malloc at 2 arenas before the worker's threads start. With an arena per thread,
/// memory one thread frees stays cached in its arena: shuffle bench (10 M rows, 4 workers,
/// 89 MiB budget), peak RSS per worker 650-675 MiB uncapped, 430-450 MiB capped. mimalloc
/// peaked at 780-930 MiB in the same bench, so the worker binaries use the system allocator.
pub fn limit_malloc_arenas() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        unsafe extern "C" {
            fn mallopt(param: std::ffi::c_int, value: std::ffi::c_int) -> std::ffi::c_int;
        }
        const M_ARENA_MAX: std::ffi::c_int = -8; // glibc's malloc.h
                                                 // SAFETY: mallopt only sets an allocator parameter; glibc refuses values it rejects.
        unsafe {
            mallopt(M_ARENA_MAX, 2);
        }
    }
}

/// Hand the allocator's free memory back to the kernel; true if some was.
pub fn release_free_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        unsafe extern "C" {
            fn malloc_trim(pad: usize) -> std::ffi::c_int;
        }
        // SAFETY: malloc_trim only returns free pages of glibc's own heaps to the kernel.
        unsafe { malloc_trim(0) != 0 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    false
}

/// Run for the worker's life: each time its last running task ends and no other starts for
/// [`IDLE_FOR`], release free memory ([`release_free_memory`], off the async threads).
pub async fn trim_when_idle(admission: Arc<Admission>) {
    loop {
        admission.idle().await;
        let admitted = admission.metrics().admitted;
        tokio::time::sleep(IDLE_FOR).await;
        // Idle all along: no task started (and ended) meanwhile.
        if admission.is_idle() && admission.metrics().admitted == admitted {
            let _ = tokio::task::spawn_blocking(release_free_memory).await;
        }
    }
}
