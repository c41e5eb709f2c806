//! Query results left on the workers, for clients that read them there (the Flight SQL
//! endpoint's, [`crate::flight_sql`]): the driver's part of the plan runs as one more stage on
//! the workers ([`crate::planner::hold_on_workers`]), its exchange gathering into one
//! partition with strategy `pull`, so each task's rows stay on the worker that ran it. Nothing
//! reads that exchange on the driver; it stays sealed until [`DistributedContext::release`].
//! A client reads each holder's share with the workers' own `DoGet` of that partition, which
//! streams the blocks committed there: together, every row once.

use crate::context::DistributedContext;
use crate::planner::StagedPlan;
use crate::result::{Held, StageMetrics};
use crate::Result;
use datafusion::common::ParamValues;
use datafusion::physical_plan::ExecutionPlan;
use flightshuffle::block::ShuffleId;
use flightshuffle::strategy::Strategy;
use std::collections::BTreeMap;
use std::sync::Arc;

impl DistributedContext {
    /// `staged` with its driver's part as one more stage whose rows stay on the workers, and
    /// that stage's shuffle; None where that cannot be (the query runs whole on the driver, or
    /// the new stage would not reach the workers as planned).
    pub(crate) fn to_hold(&self, staged: &StagedPlan) -> Result<Option<(StagedPlan, ShuffleId)>> {
        let Some((mut held, stage)) = crate::planner::hold_on_workers(staged) else {
            return Ok(None);
        };
        let Some(last) = held.stages.iter().find(|s| s.id() == stage) else {
            return Ok(None);
        };
        let writer = last.writer.clone() as Arc<dyn ExecutionPlan>;
        if let Err(why) = crate::sendable::check(&writer, &self.task_ctx()) {
            tracing::debug!(%why, "a result read on the driver: its last stage stays there");
            return Ok(None);
        }
        let shuffle = last.writer.shuffle;
        held.set_strategy(stage, Strategy::Pull)?;
        Ok(Some((held, shuffle)))
    }

    /// Where the rows of the sealed `shuffle` (a held result) are, from the driver's manifest.
    pub(crate) fn held(&self, shuffle: ShuffleId, stages: &[StageMetrics]) -> Held {
        let mut by_worker: BTreeMap<usize, u64> = BTreeMap::new();
        for b in self.driver.blocks_of(shuffle) {
            if b.meta.id.partition == 0 {
                *by_worker.entry(b.worker).or_default() += b.meta.rows;
            }
        }
        let addresses = self.driver.addresses();
        let holders: Vec<(usize, String, u64)> = by_worker
            .into_iter()
            .filter_map(|(w, rows)| Some((w, addresses.get(w)?.clone(), rows)))
            .collect();
        let rows = stages
            .iter()
            .find(|s| s.shuffle == shuffle.to_string())
            .map_or_else(|| holders.iter().map(|h| h.2).sum(), |s| s.rows);
        Held {
            shuffle,
            holders,
            rows,
        }
    }

    /// Run `sql` with its rows left on the workers where it can (see the module doc); a query
    /// that cannot, `EXPLAIN` and `SET` return their rows as [`Self::sql`] does (no `held`).
    pub async fn sql_held(&self, sql: &str) -> Result<crate::QueryResult> {
        self.sql_hold(sql, None, true).await
    }

    /// [`Self::sql_held`] with `params` bound to the query's placeholders (`$1`, `$2`, ...: a
    /// prepared statement's parameters).
    pub async fn sql_held_with(
        &self,
        sql: &str,
        params: Option<ParamValues>,
    ) -> Result<crate::QueryResult> {
        crate::context::PARAMS
            .scope(params, self.sql_held(sql))
            .await
    }

    /// [`Self::sql`] with `params` bound to the query's placeholders.
    pub async fn sql_params(
        &self,
        sql: &str,
        params: Option<ParamValues>,
    ) -> Result<crate::QueryResult> {
        crate::context::PARAMS.scope(params, self.sql(sql)).await
    }

    /// Free a held result's rows on the workers.
    pub async fn release(&self, held: &Held) -> Result<()> {
        Ok(self.driver.drop_shuffle(held.shuffle).await?)
    }
}
