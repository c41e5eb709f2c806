//! DataFusion's combiner for in-exchange combining (see `flightshuffle::combine`): a hash exchange
//! whose rows are a partial aggregate's output, hashed on its group columns, carries an
//! `AggregateExec` in `PartialReduce` mode (partial states in, partial states out). Workers
//! run it over a map task's buffer of one partition, and over the blocks a merge task merges,
//! so each key leaves a worker's buffer once, not once per plan partition or per map output.
//! The consumer's final aggregate is unchanged: it merges states whatever their number.
//!
//! Filters and projections the consumer needs are already below the exchange: DataFusion
//! pushes them under the partial aggregate (and so into the map side) when it plans.

use crate::codec::ExchangeCodec;
use crate::writer::{ShuffleWriterExec, WriterKind};
use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use datafusion::datasource::memory::MemorySourceConfig;
use datafusion::execution::TaskContext;
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode};
use datafusion::physical_plan::empty::EmptyExec;
use datafusion::physical_plan::{collect, replace_children_if_necessary, ExecutionPlan};
use datafusion::prelude::SessionContext;
use datafusion_proto::bytes::{
    physical_plan_from_bytes_with_extension_codec, physical_plan_to_bytes_with_extension_codec,
};
use flightshuffle::combine::{Combiner, CombinerKind};
use flightshuffle::proto;
use std::sync::Arc;

/// Combiner kind of a partial aggregate's exchange.
pub const PARTIAL_REDUCE: &str = "datafusion-partial-reduce";

/// The combine spec of `writer`'s exchange: `Some` when it hash-partitions a partial
/// aggregate's output (then its keys are the group columns, so no key is split).
pub fn spec_for(writer: &ShuffleWriterExec) -> crate::Result<Option<proto::TaskSource>> {
    if writer.kind != WriterKind::Hash {
        return Ok(None);
    }
    let Some(agg) = writer.input().downcast_ref::<AggregateExec>() else {
        return Ok(None);
    };
    Ok(partial_reduce(agg)?.map(|payload| proto::TaskSource {
        kind: PARTIAL_REDUCE.into(),
        payload,
    }))
}

/// The `PartialReduce` plan (encoded) that combines the states `agg` emits, if it is a
/// partial aggregate whose states keep their columns when combined.
pub fn partial_reduce(agg: &AggregateExec) -> crate::Result<Option<Vec<u8>>> {
    if *agg.mode() != AggregateMode::Partial {
        return Ok(None);
    }
    let input = Arc::new(EmptyExec::new(agg.schema()));
    let reduce = AggregateExec::try_new(
        AggregateMode::PartialReduce,
        agg.group_expr().as_final(),
        agg.aggr_expr().to_vec(),
        vec![None; agg.aggr_expr().len()],
        input,
        agg.input_schema(),
    )?;
    if !same_columns(&reduce.schema(), &agg.schema()) {
        return Ok(None);
    }
    Ok(Some(
        physical_plan_to_bytes_with_extension_codec(Arc::new(reduce), &ExchangeCodec)?.to_vec(),
    ))
}

fn same_columns(a: &SchemaRef, b: &SchemaRef) -> bool {
    a.fields().len() == b.fields().len()
        && a.fields()
            .iter()
            .zip(b.fields().iter())
            .all(|(x, y)| x.name() == y.name() && x.data_type() == y.data_type())
}

/// Worker side: decodes the `PartialReduce` plan once per shuffle.
#[derive(Debug, Default)]
pub struct PartialReduceKind;

impl CombinerKind for PartialReduceKind {
    fn open(&self, payload: &[u8], schema: &SchemaRef) -> flightshuffle::Result<Arc<dyn Combiner>> {
        let (plan, ctx) = decode(payload, schema)?;
        let input = plan.children()[0].schema();
        Ok(Arc::new(PartialReduce { plan, input, ctx }))
    }
}

/// The `PartialReduce` aggregate encoded in `payload`, checked to take and give `schema`'s
/// columns, and the context it runs in.
pub fn decode(
    payload: &[u8],
    schema: &SchemaRef,
) -> flightshuffle::Result<(Arc<dyn ExecutionPlan>, Arc<TaskContext>)> {
    let bad = |what: String| flightshuffle::Error::invalid(format!("combiner plan: {what}"));
    let session = SessionContext::new();
    session.register_udf(crate::double::udf());
    let ctx = session.task_ctx();
    let plan = physical_plan_from_bytes_with_extension_codec(payload, &ctx, &ExchangeCodec)
        .map_err(|e| bad(e.to_string()))?;
    let agg = plan
        .downcast_ref::<AggregateExec>()
        .ok_or_else(|| bad(format!("expected an aggregate, got {}", plan.name())))?;
    if *agg.mode() != AggregateMode::PartialReduce {
        return Err(bad(format!("expected PartialReduce, got {:?}", agg.mode())));
    }
    let input = agg.input().schema();
    if !same_columns(&input, schema) || !same_columns(&agg.schema(), schema) {
        return Err(bad("its columns are not the shuffle's".into()));
    }
    Ok((plan, ctx))
}

struct PartialReduce {
    plan: Arc<dyn ExecutionPlan>,
    input: SchemaRef,
    ctx: Arc<TaskContext>,
}

impl Combiner for PartialReduce {
    fn combine(&self, batches: &[RecordBatch]) -> flightshuffle::Result<Vec<RecordBatch>> {
        let err = |e: datafusion::error::DataFusionError| flightshuffle::Error::Task(e.to_string());
        let batches = batches
            .iter()
            .map(|b| {
                flightshuffle::block::batch_with(
                    self.input.clone(),
                    b.columns().to_vec(),
                    b.num_rows(),
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        let source =
            MemorySourceConfig::try_new_exec(&[batches], self.input.clone(), None).map_err(err)?;
        let plan = replace_children_if_necessary(self.plan.clone(), vec![source]).map_err(err)?;
        let run = collect(plan, self.ctx.clone());
        tokio::runtime::Handle::current().block_on(run).map_err(err)
    }
}
