//! The runtime map tasks run on, apart from the one serving a worker's Flight calls, at a
//! lower CPU priority (see [`runtime`]).

/// The runtime map tasks run on, apart from the one serving Flight. A map task computes for
/// long stretches without yielding: on the serving threads it held back the block reads, folds
/// and commits that other workers and the driver wait on (an online query's first fold read
/// its blocks in 15-50 ms while the next maps ran). Its worker threads run at a lower CPU
/// priority ([`lower_thread_priority`]), so where a worker shares its cores (with other
/// workers, the driver) the short serving work goes first. Its blocking threads (Python map
/// tasks holding the GIL a Python fold waits for, file reads) keep the worker's priority. If
/// the runtime cannot start, map tasks run on the serving runtime as before.
pub fn runtime() -> tokio::runtime::Handle {
    static RT: std::sync::OnceLock<Option<tokio::runtime::Runtime>> = std::sync::OnceLock::new();
    let rt = RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .thread_name(COMPUTE_THREAD)
            // Called on the runtime's worker threads only (blocking threads never park).
            .on_thread_park(lower_thread_priority)
            .build()
            .map_err(|e| tracing::warn!(error = %e, "no compute runtime: map tasks run on the serving one"))
            .ok()
    });
    match rt {
        Some(rt) => rt.handle().clone(),
        None => tokio::runtime::Handle::current(),
    }
}

/// Name of the threads map tasks run on.
pub const COMPUTE_THREAD: &str = "flightshuffle-compute";

/// How much lower than the worker's own the map tasks' CPU priority is (nice steps).
pub const COMPUTE_NICE: i32 = 10;

/// Lower the calling thread's CPU priority by [`COMPUTE_NICE`] (Linux keeps it per thread),
/// once per thread.
fn lower_thread_priority() {
    thread_local! {
        static LOWERED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }
    if LOWERED.with(|l| l.replace(true)) {
        return;
    }
    #[cfg(target_os = "linux")]
    {
        unsafe extern "C" {
            fn nice(inc: std::ffi::c_int) -> std::ffi::c_int;
        }
        // SAFETY: glibc's nice() adds to the calling thread's nice value (Linux keeps it per
        // thread), capped at 19; a refused change leaves it as it was.
        unsafe {
            nice(COMPUTE_NICE);
        }
    }
}

/// Tasks that must not outlive their spawner: aborted when this is dropped (the
/// strategy failed or its caller went away).
pub struct AbortOnDrop(pub Vec<tokio::task::AbortHandle>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        for h in &self.0 {
            h.abort();
        }
    }
}
