#![warn(missing_docs)]
//! flightshuffle's data plane and shuffle strategies.
//!
//! The data plane (blocks, block store, Flight transport, tasks, driver, local cluster) is shared by
//! every strategy; strategies in [`strategy`] only decide which task runs where and when.
//! This crate does not depend on any query engine.

mod admission;
mod allocator;
pub mod block;
mod calibrate;
pub mod checksum;
pub mod cluster;
pub mod combine;
mod compute;
mod cost;
mod direct;
pub mod driver;
mod error;
pub mod events;
mod forward;
pub mod ids;
pub mod job;
mod kept;
mod map_config;
mod packed;
mod parity;
pub mod partitioner;
mod private;
mod push;
pub mod scheduler;
pub mod source;
pub mod storage;
mod store;
pub mod strategy;
pub mod sync;
pub mod synthetic;
mod task;
pub mod transport;
pub mod worker;

/// Protobuf messages of the Flight protocol (tickets, put commands, actions).
#[allow(missing_docs)]
pub mod proto {
    include!(concat!(env!("OUT_DIR"), "/flightshuffle.rs"));
}

pub use admission::enabled as admission_enabled;
pub use block::{BlockId, BlockMeta, Compression, ShuffleId};
pub use calibrate::to_json as calibration_json;
pub use error::{Error, Result};
pub use kept::in_memory as kept_in_memory;
pub use map_config::MapConfig;
pub use parity::check as check_parity;
pub use storage::StorageConfig;
/// gRPC status codes, as carried by [`Error::Remote`].
pub use tonic as transport_code;
