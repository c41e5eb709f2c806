//! Online aggregation of SQL with the native map side.

use crate::cluster::NativeCluster;
use crate::{online, stage};
use pyo3::prelude::*;

#[pymethods]
impl NativeCluster {
    /// Online aggregation of SQL with the native map side: `sql` is the statistics query,
    /// `splits` cut the fact table (path, file bytes, file rows, first row, rows) in the order
    /// they are read, folded in an early first round and then `rounds` rounds as they commit;
    /// with `top` (column, divisor, null as zero, descending, k) each fold sends only the
    /// groups that can be among the first k in that order. `tables` are (name, Parquet path,
    /// a version of its files). Returns the stream and the staged plan's text.
    #[pyo3(signature = (sql, tables, splits, rounds, top=None))]
    fn online_sql(
        &self,
        py: Python<'_>,
        sql: String,
        tables: Vec<online::TableTuple>,
        splits: Vec<online::SplitTuple>,
        rounds: usize,
        top: Option<online::TopTuple>,
    ) -> PyResult<(stage::NativeStream, String)> {
        let driver = self.driver()?;
        online::start(
            py,
            &self.rt,
            &self.online,
            driver,
            self.strategy,
            sql,
            tables,
            splits,
            rounds,
            top,
        )
    }
}
