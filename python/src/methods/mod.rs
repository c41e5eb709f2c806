//! The methods of `NativeCluster` by domain, each an `#[pymethods]` block of its own (PyO3's
//! `multiple-pymethods`): datasets (Python map stages and streaming jobs), online aggregation of
//! SQL, shuffles, and distributed SQL. The class and its lifecycle are in `cluster.rs`.

mod datasets;
mod online;
mod shuffle;
mod sql;
