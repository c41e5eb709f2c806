//! Stopping a worker process from its driver. A driver without a way to start workers (a
//! static cluster, whose workers a supervisor such as systemd or Kubernetes runs) that gave a
//! worker up for lost and then hears it answer again (it was paused, or cut off) sends it
//! [`crate::transport::actions::EXIT`]: the process exits, its supervisor starts a fresh one at
//! the same address, and the driver takes that one as the slot's replacement. A worker hosted
//! inside another process (tests, embedding) refuses: only a worker process owns its exit.

use crate::error::{Error, Result};
use crate::store::BlockStore;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// The exit status of a fenced worker: not 0, so that a supervisor restarting on failure
/// (systemd `Restart=on-failure`) starts it again (75 is `EX_TEMPFAIL`).
pub const FENCED_EXIT: i32 = 75;

/// Set once this process serves as a worker process: the store whose files go on exit.
static OWNED: OnceLock<Arc<BlockStore>> = OnceLock::new();

/// This process is a worker process serving `store` (the worker binary's `main`).
pub(super) fn own_process(store: Arc<BlockStore>) {
    let _ = OWNED.set(store);
}

/// Remove the files the store wrote (nobody reads these blocks again; `--spill-dir` may name
/// a directory with other files in it, which stay) and exit with `code`.
pub(super) fn exit_now(code: i32) -> ! {
    if let Some(store) = OWNED.get() {
        store.remove_files();
    }
    std::process::exit(code)
}

/// Exit shortly, after the reply to the call that asked has gone out; refused when this is
/// not a worker process.
pub(super) fn exit_soon() -> Result<()> {
    if OWNED.get().is_none() {
        return Err(Error::Precondition(
            "this worker runs inside a host process, which a driver cannot stop".into(),
        ));
    }
    tracing::warn!("fenced by the driver (it gave this worker up for lost): exiting");
    std::thread::spawn(|| {
        std::thread::sleep(Duration::from_millis(200));
        exit_now(FENCED_EXIT)
    });
    Ok(())
}
