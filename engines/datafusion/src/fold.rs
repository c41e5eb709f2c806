//! The workers' side of online aggregation ([`crate::online`]): [`PartialFold`] folds each
//! round's partial aggregate states of one partition into its running state, and emits what
//! the driver needs for its estimates.
//!
//! Every round the driver turns the emitted states into estimates, sorts them and, for
//! `ORDER BY ... LIMIT k`, keeps the first k. A partition then needs to send only the rows
//! that can be among those k ([`EmitTop`]): the groups are hash-partitioned on their keys, so
//! each lives in one partition, and a group that has k or more groups ordered strictly before
//! it in its own partition has as many before it overall. Estimates of SUM and COUNT are the
//! folded sums scaled by one positive factor (the share of the input read), AVG is their
//! ratio, MIN and MAX are as folded: the order of the estimates is the order of values a
//! worker computes from its states without knowing the factor (one caveat: two sums that
//! differ can round to the same estimate in an early round, where a second ORDER BY key may
//! then prefer the group not sent; the final round, unscaled, is exact). The state itself
//! stays whole; only what is sent shrinks (TPC-H Q10 at SF1: 38 K groups, 20 returned).

use crate::combine::PartialReduceKind;
use crate::distinct_counts::DistinctCounts;
use crate::running::Running;
use arrow::array::{Array, ArrayRef, AsArray, Float64Array, RecordBatch, Scalar};
use arrow::compute::kernels::cmp::{gt_eq, lt_eq};
use arrow::compute::{cast, concat, filter_record_batch, sort_to_indices, SortOptions};
use arrow::datatypes::{DataType, Float64Type, SchemaRef};
use datafusion::physical_plan::aggregates::AggregateExec;
use flightshuffle::combine::{Combiner, CombinerKind};
use flightshuffle::source::{ReduceState, Reducer};
use prost::Message;
use std::sync::Arc;

/// Reducer kind folding partial aggregate states (payload: an encoded [`FoldPayload`]).
pub const PARTIAL_FOLD: &str = "datafusion-partial-fold";

/// What a fold is given with every round.
#[derive(Clone, PartialEq, prost::Message)]
pub struct FoldPayload {
    /// The `PartialReduce` plan that combines partial states (encoded).
    #[prost(bytes = "vec", tag = "1")]
    pub plan: Vec<u8>,
    /// Emit only the candidates for the first `k` rows (None: every group).
    #[prost(message, optional, tag = "2")]
    pub top: Option<EmitTop>,
    /// A COUNT(DISTINCT): emit its counts per group ([`crate::distinct_counts`]).
    #[prost(message, optional, tag = "3")]
    pub distinct: Option<DistinctCounts>,
}

/// What each fold partition sends the driver every round: every group's state by default.
#[derive(Clone, Debug, Default)]
pub struct FoldEmit {
    /// Only the candidates for the first `k` rows.
    pub top: Option<EmitTop>,
    /// A COUNT(DISTINCT)'s counts per group instead of its state per group and value.
    pub distinct: Option<DistinctCounts>,
}

/// The query's first ordering key, as a value per folded row, and its LIMIT.
#[derive(Clone, PartialEq, prost::Message)]
pub struct EmitTop {
    /// Column of the folded states (group keys, then statistics) holding the value.
    #[prost(uint32, tag = "1")]
    pub column: u32,
    /// An AVG: the value is `column / divisor` (null where the divisor is not positive).
    #[prost(uint32, optional, tag = "2")]
    pub divisor: Option<u32>,
    /// A SUM: a null sum is estimated as 0.
    #[prost(bool, tag = "3")]
    pub null_as_zero: bool,
    /// Whether the ordering is descending (largest values first).
    #[prost(bool, tag = "4")]
    pub descending: bool,
    /// The query's LIMIT.
    #[prost(uint64, tag = "5")]
    pub k: u64,
}

/// A partition's running state, and what folds it (decoded once).
struct FoldState {
    schema: SchemaRef,
    folded: Folded,
    top: Option<EmitTop>,
    distinct: Option<DistinctCounts>,
}

enum Folded {
    /// Groups interned once, states merged into accumulators (see [`crate::running`]), and
    /// every group's states after the last fold.
    Running(Box<Running>, Vec<RecordBatch>),
    /// The states combined per group so far, all combined again with each round's blocks
    /// (aggregates [`Running`] cannot take).
    Combined {
        combiner: Arc<dyn Combiner>,
        batches: Vec<RecordBatch>,
    },
}

fn foreign() -> flightshuffle::Error {
    flightshuffle::Error::invalid("partial fold given a foreign state")
}

fn task_err(e: datafusion::error::DataFusionError) -> flightshuffle::Error {
    flightshuffle::Error::Task(format!("online fold: {e}"))
}

/// Folds the partial aggregate states of an online query's fact stage into the running
/// state of the partition.
pub struct PartialFold;

impl Reducer for PartialFold {
    fn fold(
        &self,
        payload: &[u8],
        state: Option<ReduceState>,
        batches: Vec<RecordBatch>,
        schema: SchemaRef,
    ) -> flightshuffle::Result<ReduceState> {
        let mut state = match state {
            Some(s) => *s.downcast::<FoldState>().map_err(|_| foreign())?,
            None => {
                let p = FoldPayload::decode(payload).map_err(|e| {
                    flightshuffle::Error::invalid(format!("partial fold payload: {e}"))
                })?;
                let (plan, _) = crate::combine::decode(&p.plan, &schema)?;
                let running = match plan.downcast_ref::<AggregateExec>() {
                    Some(agg) => Running::try_new(agg, schema.clone()).map_err(task_err)?,
                    None => None,
                };
                let folded = match running {
                    Some(r) => Folded::Running(Box::new(r), Vec::new()),
                    None => Folded::Combined {
                        combiner: PartialReduceKind.open(&p.plan, &schema)?,
                        batches: Vec::new(),
                    },
                };
                FoldState {
                    schema,
                    folded,
                    top: p.top,
                    distinct: p.distinct,
                }
            }
        };
        match &mut state.folded {
            Folded::Running(running, all) => {
                let mut added = false;
                for b in batches.iter().filter(|b| b.num_rows() > 0) {
                    running.add(b).map_err(task_err)?;
                    added = true;
                }
                if added {
                    *all = running.snapshot().map_err(task_err)?;
                }
            }
            Folded::Combined {
                combiner,
                batches: kept,
            } => {
                if batches.iter().any(|b| b.num_rows() > 0) {
                    let mut all = std::mem::take(kept);
                    all.extend(batches);
                    *kept = combiner.combine(&all)?;
                }
            }
        }
        Ok(Box::new(state))
    }

    fn emit(
        &self,
        _payload: &[u8],
        state: &ReduceState,
    ) -> flightshuffle::Result<(SchemaRef, Vec<RecordBatch>)> {
        let s = state.downcast_ref::<FoldState>().ok_or_else(foreign)?;
        let all = match &s.folded {
            Folded::Running(_, all) => all.clone(),
            Folded::Combined { batches, .. } => batches.clone(),
        };
        if let Some(spec) = &s.distinct {
            return crate::distinct_counts::counts(spec, &s.schema, &all).map_err(|e| {
                flightshuffle::Error::Task(format!("online fold: COUNT(DISTINCT): {e}"))
            });
        }
        let batches = match &s.top {
            Some(top) => candidates(&all, top).unwrap_or_else(|e| {
                // Never worse than sending everything.
                tracing::debug!(error = %e, "online fold: sending every group");
                all
            }),
            None => all,
        };
        Ok((s.schema.clone(), batches))
    }
}

/// Whether a fold state merges rounds into a [`Running`] state (for tests).
#[cfg(test)]
pub(crate) fn is_running(state: &ReduceState) -> bool {
    matches!(
        state.downcast_ref::<FoldState>().map(|s| &s.folded),
        Some(Folded::Running(..))
    )
}

/// The rows of `batches` that can be among the first `top.k` in `top`'s order: every row
/// ordered no later than the k-th, ties included; rows whose value is null only when fewer
/// than k values are not (nulls sort last).
pub fn candidates(
    batches: &[RecordBatch],
    top: &EmitTop,
) -> Result<Vec<RecordBatch>, arrow::error::ArrowError> {
    let Some(first) = batches.first() else {
        return Ok(Vec::new());
    };
    let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
    let k = usize::try_from(top.k).unwrap_or(usize::MAX);
    if rows <= k {
        return Ok(batches.to_vec());
    }
    if k == 0 {
        return Ok(vec![first.slice(0, 0)]);
    }
    // Only the ordering values are put together; the rows stay in their batches.
    let values = batches
        .iter()
        .map(|b| order_values(b, top))
        .collect::<Result<Vec<_>, _>>()?;
    let all = concat(&values.iter().map(|v| v.as_ref()).collect::<Vec<_>>())?;
    let opts = SortOptions {
        descending: top.descending,
        nulls_first: false,
    };
    let firsts = sort_to_indices(&all, Some(opts), Some(k))?;
    let kth = firsts.value(k - 1) as usize;
    if all.is_null(kth) {
        return Ok(batches.to_vec());
    }
    let threshold = Scalar::new(all.slice(kth, 1));
    let mut out = Vec::new();
    for (batch, values) in batches.iter().zip(&values) {
        let keep = if top.descending {
            gt_eq(values, &threshold)?
        } else {
            lt_eq(values, &threshold)?
        };
        let kept = filter_record_batch(batch, &keep)?;
        if kept.num_rows() > 0 {
            out.push(kept);
        }
    }
    Ok(out)
}

/// The value each row is ordered by, as the driver's estimates order it.
fn order_values(batch: &RecordBatch, top: &EmitTop) -> Result<ArrayRef, arrow::error::ArrowError> {
    let column = |i: u32| {
        batch.columns().get(i as usize).cloned().ok_or_else(|| {
            arrow::error::ArrowError::InvalidArgumentError(format!(
                "ordering column {i} of {} columns",
                batch.num_columns()
            ))
        })
    };
    let value = column(top.column)?;
    let floats = |a: &ArrayRef| -> Result<Float64Array, arrow::error::ArrowError> {
        Ok(cast(a, &DataType::Float64)?
            .as_primitive::<Float64Type>()
            .clone())
    };
    let out: Float64Array = match top.divisor {
        Some(d) => {
            let (s, c) = (floats(&value)?, floats(&column(d)?)?);
            s.iter()
                .zip(c.iter())
                .map(|(s, c)| match c {
                    Some(c) if c > 0.0 => Some(canonical(s.unwrap_or(0.0) / c)),
                    _ => None,
                })
                .collect()
        }
        None if top.null_as_zero => floats(&value)?
            .iter()
            .map(|s| Some(canonical(s.unwrap_or(0.0))))
            .collect(),
        None if value.data_type().is_floating() => {
            floats(&value)?.iter().map(|s| s.map(canonical)).collect()
        }
        None => return Ok(value),
    };
    Ok(Arc::new(out))
}

/// One zero and one NaN: the driver orders -0.0 with 0.0 and every NaN as the largest value.
fn canonical(x: f64) -> f64 {
    if x.is_nan() {
        f64::NAN
    } else {
        x + 0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Int64Array, StringArray};
    use arrow::datatypes::{Field, Schema};
    use proptest::prelude::*;

    fn batch(keys: Vec<i64>, sums: Vec<Option<f64>>, counts: Vec<i64>) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, false),
            Field::new("s", DataType::Float64, true),
            Field::new("c", DataType::Int64, false),
        ]));
        RecordBatch::try_new(
            schema,
            vec![
                Arc::new(Int64Array::from(keys)),
                Arc::new(Float64Array::from(sums)),
                Arc::new(Int64Array::from(counts)),
            ],
        )
        .unwrap()
    }

    fn keys(batches: &[RecordBatch]) -> Vec<i64> {
        let mut out: Vec<i64> = batches
            .iter()
            .flat_map(|b| {
                b.column(0)
                    .as_primitive::<arrow::datatypes::Int64Type>()
                    .values()
                    .to_vec()
            })
            .collect();
        out.sort();
        out
    }

    fn top(
        column: u32,
        divisor: Option<u32>,
        null_as_zero: bool,
        descending: bool,
        k: u64,
    ) -> EmitTop {
        EmitTop {
            column,
            divisor,
            null_as_zero,
            descending,
            k,
        }
    }

    #[test]
    fn the_first_k_and_their_ties_are_sent() {
        let b = batch(
            vec![1, 2, 3, 4, 5, 6],
            vec![Some(5.0), Some(9.0), Some(7.0), Some(7.0), None, Some(-0.0)],
            vec![1, 3, 7, 1, 2, 4],
        );
        let got = |t: EmitTop| keys(&candidates(std::slice::from_ref(&b), &t).unwrap());
        // SUM DESC, 2: 9 and the two tied 7s.
        assert_eq!(got(top(1, None, true, true, 2)), vec![2, 3, 4]);
        // SUM ASC, 2: a null sum is 0, -0.0 is 0: tied.
        assert_eq!(got(top(1, None, true, false, 2)), vec![5, 6]);
        // MIN-like ASC without null_as_zero: nulls last, -0.0 first.
        assert_eq!(got(top(1, None, false, false, 1)), vec![6]);
        // AVG = s / c DESC, 1: 7/1 for key 4.
        assert_eq!(got(top(1, Some(2), true, true, 1)), vec![4]);
        // COUNT ASC, 2: 1 and 1.
        assert_eq!(got(top(2, None, false, false, 2)), vec![1, 4]);
        // A key column DESC.
        assert_eq!(got(top(0, None, false, true, 3)), vec![4, 5, 6]);
        // Fewer values than k that are not null: the nulls too.
        let nulls = batch(vec![1, 2, 3], vec![Some(1.0), None, None], vec![1, 1, 1]);
        let sent = candidates(&[nulls], &top(1, None, false, true, 2)).unwrap();
        assert_eq!(keys(&sent), vec![1, 2, 3]);
        // k of 0 and k over the rows.
        assert!(
            keys(&candidates(std::slice::from_ref(&b), &top(1, None, true, true, 0)).unwrap())
                .is_empty()
        );
        assert_eq!(got(top(1, None, true, true, 10)).len(), 6);
        // A column that is not there is an error (the fold then sends everything).
        assert!(candidates(std::slice::from_ref(&b), &top(7, None, true, true, 2)).is_err());
    }

    #[test]
    fn strings_order_as_bytes() {
        let schema = Arc::new(Schema::new(vec![Field::new("m", DataType::Utf8, true)]));
        let b = RecordBatch::try_new(
            schema,
            vec![Arc::new(StringArray::from(vec![
                Some("b"),
                None,
                Some("a"),
                Some("c"),
            ]))],
        )
        .unwrap();
        let sent = candidates(&[b], &top(0, None, false, false, 2)).unwrap();
        let got: Vec<_> = sent[0]
            .column(0)
            .as_string::<i32>()
            .iter()
            .flatten()
            .collect();
        assert_eq!(got, vec!["b", "a"]);
    }

    proptest! {
        /// Whatever the values, partitions and k: the first k rows of everything, in the
        /// driver's order (value, then key), are among the partitions' candidates.
        #[test]
        fn every_global_top_row_is_a_candidate(
            rows in proptest::collection::vec((0i64..6, prop::option::of(-3i64..3), 0i64..4), 0..60),
            parts in 1usize..4,
            k in 0u64..8,
            descending: bool,
            avg: bool,
        ) {
            let n = rows.len();
            let keys_all: Vec<i64> = (0..n as i64).collect();
            let sums: Vec<Option<f64>> = rows.iter().map(|r| r.1.map(|v| v as f64)).collect();
            let counts: Vec<i64> = rows.iter().map(|r| r.2).collect();
            let t = top(1, avg.then_some(2), true, descending, k);
            // The driver's value and order.
            let value = |i: usize| -> Option<f64> {
                let s = sums[i].unwrap_or(0.0);
                if avg { (counts[i] > 0).then(|| s / counts[i] as f64) } else { Some(s) }
            };
            let mut order: Vec<usize> = (0..n).collect();
            order.sort_by(|&a, &b| {
                let (x, y) = (value(a), value(b));
                let by = match (x, y) {
                    (None, None) => std::cmp::Ordering::Equal,
                    (None, _) => std::cmp::Ordering::Greater,
                    (_, None) => std::cmp::Ordering::Less,
                    (Some(x), Some(y)) if descending => y.total_cmp(&x),
                    (Some(x), Some(y)) => x.total_cmp(&y),
                };
                by.then(a.cmp(&b))
            });
            let want: Vec<i64> = order.into_iter().take(k as usize).map(|i| i as i64).collect();
            let mut sent = Vec::new();
            for p in 0..parts {
                let idx: Vec<usize> = (0..n).filter(|i| rows[*i].0 as usize % parts == p).collect();
                let b = batch(
                    idx.iter().map(|&i| keys_all[i]).collect(),
                    idx.iter().map(|&i| sums[i]).collect(),
                    idx.iter().map(|&i| counts[i]).collect(),
                );
                // In two batches, as a running fold's chunks come.
                let cut = b.num_rows() / 2;
                let halves = [b.slice(0, cut), b.slice(cut, b.num_rows() - cut)];
                sent.extend(keys(&candidates(&halves, &t).unwrap()));
            }
            for w in want {
                prop_assert!(sent.contains(&w), "row {} missing from {:?}", w, sent);
            }
        }
    }
}

/// The running aggregate ([`crate::running`]) through the fold path.
#[cfg(test)]
mod running_tests {
    use super::*;
    use crate::combine::{partial_reduce, PartialReduceKind};
    use arrow::array::{Int32Array, Int64Array, StringArray, StringViewArray};
    use arrow::datatypes::{DataType, Field, Schema};
    use arrow::util::pretty::pretty_format_batches;
    use datafusion::datasource::MemTable;
    use datafusion::physical_plan::{collect, ExecutionPlan};
    use datafusion::prelude::{SessionConfig, SessionContext};
    use flightshuffle::combine::CombinerKind;
    use flightshuffle::source::Reducer;
    use proptest::prelude::*;
    use prost::Message;

    type Row = (Option<u8>, i64, Option<i32>);

    fn input(rows: &[Row], view: bool) -> RecordBatch {
        let kind = if view {
            DataType::Utf8View
        } else {
            DataType::Utf8
        };
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", kind, true),
            Field::new("g", DataType::Int64, false),
            Field::new("x", DataType::Int32, true),
        ]));
        // Long enough that views point into the data buffer.
        let keys = rows
            .iter()
            .map(|r| r.0.map(|v| format!("key number {v} of the test")));
        let k: ArrayRef = if view {
            Arc::new(keys.collect::<StringViewArray>())
        } else {
            Arc::new(keys.collect::<StringArray>())
        };
        let g: Int64Array = rows.iter().map(|r| r.1).collect();
        let x: Int32Array = rows.iter().map(|r| r.2).collect();
        RecordBatch::try_new(schema, vec![k, Arc::new(g), Arc::new(x)]).unwrap()
    }

    fn partial(plan: &Arc<dyn ExecutionPlan>) -> Option<Arc<dyn ExecutionPlan>> {
        if let Some(a) = plan.downcast_ref::<AggregateExec>() {
            if *a.mode() == datafusion::physical_plan::aggregates::AggregateMode::Partial {
                return Some(plan.clone());
            }
        }
        plan.children().into_iter().find_map(partial)
    }

    /// Sorted lines of the rows (group order differs between the two ways).
    fn lines(batches: &[RecordBatch]) -> Vec<String> {
        let text = pretty_format_batches(batches).unwrap().to_string();
        let mut out: Vec<String> = text.lines().skip(3).map(str::to_string).collect();
        out.sort();
        out
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(40))]
        /// Folding partial states batch by batch, snapshotting after each round, ends where
        /// combining all of them at once does (SUM, COUNT, MIN, MAX, AVG; null keys and
        /// values; one key or two, Utf8 or Utf8View), and every snapshot is the combination
        /// of what was added so far; a batch of other columns is an error.
        #[test]
        fn folding_round_by_round_equals_combining_at_once(
            rows in proptest::collection::vec(
                (prop::option::of(0u8..5), 0i64..3, prop::option::of(-50i32..50)), 4..200),
            parts in 2usize..5,
            rounds in 1usize..4,
            view: bool,
            one_key: bool,
        ) {
            let rt = tokio::runtime::Runtime::new().unwrap();
            rt.block_on(async {
                let chunk = rows.len().div_ceil(parts).max(1);
                let batches: Vec<Vec<RecordBatch>> =
                    rows.chunks(chunk).map(|c| vec![input(c, view)]).collect();
                let ctx = SessionContext::new_with_config(
                    SessionConfig::new().with_target_partitions(batches.len().max(2)),
                );
                let table = MemTable::try_new(batches[0][0].schema(), batches).unwrap();
                ctx.register_table("t", Arc::new(table)).unwrap();
                let keys = if one_key { "k" } else { "k, g" };
                let sql = format!(
                    "SELECT {keys}, SUM(x), COUNT(x), COUNT(*), MIN(x), MAX(k), AVG(x) \
                     FROM t GROUP BY {keys}"
                );
                let plan = ctx.sql(&sql).await.unwrap().create_physical_plan().await.unwrap();
                let agg_plan = partial(&plan).expect("a partial aggregate");
                let agg = agg_plan.downcast_ref::<AggregateExec>().unwrap();
                let states = collect(agg_plan.clone(), ctx.task_ctx()).await.unwrap();
                let schema = agg_plan.schema();
                let payload = partial_reduce(agg).unwrap().expect("a PartialReduce plan");
                let (plan, _) = crate::combine::decode(&payload, &schema).unwrap();
                let reduce = plan.downcast_ref::<AggregateExec>().unwrap();
                let combiner = PartialReduceKind.open(&payload, &schema).unwrap();
                let mut running = Running::try_new(reduce, schema.clone()).unwrap().unwrap();
                let per_round = states.len().div_ceil(rounds).max(1);
                let mut added = Vec::new();
                // The same rounds through the reducer the workers run.
                let fold_payload = FoldPayload { plan: payload.clone(), top: None, distinct: None }.encode_to_vec();
                let mut folded = None;
                for round in states.chunks(per_round) {
                    for b in round {
                        running.add(b).unwrap();
                    }
                    added.extend(round.iter().cloned());
                    let got = running.snapshot().unwrap();
                    let want = tokio::task::block_in_place(|| combiner.combine(&added)).unwrap();
                    prop_assert_eq!(lines(&got), lines(&want));
                    let state = PartialFold
                        .fold(&fold_payload, folded.take(), round.to_vec(), schema.clone())
                        .unwrap();
                    prop_assert!(super::is_running(&state), "the fold took the running path");
                    let (_, emitted) = PartialFold.emit(&fold_payload, &state).unwrap();
                    prop_assert_eq!(lines(&emitted), lines(&want));
                    folded = Some(state);
                }
                let all = tokio::task::block_in_place(|| combiner.combine(&states)).unwrap();
                prop_assert_eq!(running.len(), lines(&all).len() - 1);
                prop_assert!(running.add(&input(&rows, view)).is_err());
                Ok(())
            })?;
        }
    }
}
