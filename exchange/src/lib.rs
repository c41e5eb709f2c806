//! flightshuffle's data plane and shuffle strategies.
//!
//! The data plane (blocks, block store, Flight transport, tasks, driver, local cluster) is shared by
//! every strategy; strategies in [`strategy`] only decide which task runs where and when.
//! This crate does not depend on any query engine.

pub mod admission;
pub mod allocator;
pub mod bench;
pub mod block;
pub mod calibrate;
pub mod checksum;
pub mod cluster;
pub mod combine;
pub mod compute;
pub mod cost;
pub mod driver;
pub mod error;
pub mod forward;
pub mod gen;
pub mod ids;
pub mod job;
pub mod kept;
pub mod map_config;
pub mod packed;
pub mod parity;
pub mod partitioner;
pub mod private;
pub mod push;
pub mod scheduler;
pub mod source;
pub mod store;
pub mod strategy;
pub mod task;
pub mod transport;
pub mod worker;

/// Protobuf messages of the Flight protocol (tickets, put commands, actions).
pub mod proto {
    include!(concat!(env!("OUT_DIR"), "/flightshuffle.rs"));
}

pub use block::{BlockId, BlockMeta, Compression, ShuffleId};
pub use error::{Error, Result};
/// gRPC status codes, as carried by [`Error::Remote`].
pub use tonic as transport_code;
