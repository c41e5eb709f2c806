//! Submitting a map attempt: the task as the shuffle's placement, packing and parity ask,
//! run (a worker-side source, or batches streamed from the driver), then claimed, committed
//! on every worker holding its blocks, and recorded in the shuffle's manifest: where it ran,
//! every holder it pushed to, its rows per partition and its lineage. The first attempt of a
//! map to finish claims it; another is cancelled ([`Error::Superseded`]).

use super::placement::Placement;
use super::{Driver, Lineage, Made, MapDone, MapInput};
use crate::block::ShuffleId;
use crate::checksum::Checksum;
use crate::error::{Error, Result};
use crate::proto;
use arrow::datatypes::SchemaRef;
use std::sync::Arc;

impl Driver {
    /// Start an attempt of a map task on `worker`; returns at once with its handle. The
    /// handle resolves once the attempt ran and the driver committed it on the worker (its
    /// blocks are then visible to readers). A failed attempt's blocks are removed by the worker.
    pub fn submit_map(
        self: &Arc<Self>,
        shuffle: ShuffleId,
        map: u32,
        worker: usize,
        input: MapInput,
    ) -> tokio::task::JoinHandle<Result<MapDone>> {
        let me = self.clone();
        let (checksum, map_placement, partitions, pack) = self
            .with_shuffle(shuffle, |e| {
                (
                    e.schema.as_ref().is_none_or(|(_, c)| *c),
                    e.map_placement,
                    e.partitions,
                    e.packing,
                )
            })
            .unwrap_or((true, None, None, false));
        let attempt = self.next_attempt(shuffle, map);
        // The process in the slot now: a replacement started later does not hold the output.
        let generation = self.generation(worker);
        let n = self.num_workers();
        let placement = map_placement.unwrap_or_else(|| self.placement(shuffle));
        let pushes = placement != Placement::Local;
        let partitions = match partitions {
            Some(p) => p,
            None if pushes => {
                return tokio::spawn(async move { Err(Error::UnknownShuffle(shuffle)) })
            }
            None => 0,
        };
        let task = proto::MapTask {
            shuffle_id: shuffle.0,
            map_id: map,
            attempt,
            source: None,
            skip_checksum: !checksum,
            push_peers: if pushes { self.addresses() } else { vec![] },
            push_to: if pushes {
                (0..partitions)
                    .map(|p| placement.holder(worker, p, n) as u32)
                    .collect()
            } else {
                vec![]
            },
            worker_index: worker as u32,
            pack,
            parity: self.parity_of(shuffle),
        };
        // Parity shuffles: every slot's process now (the map leaves blocks on all of them).
        let generations: Vec<u64> = (0..n).map(|i| self.generation(i)).collect();
        // The workers this attempt may have left blocks on (to cancel it everywhere).
        let holders: Vec<usize> = if pushes {
            (0..n).collect()
        } else {
            vec![worker]
        };
        let lineage = match &input {
            MapInput::Source(s) => Lineage::Source(s.clone()),
            MapInput::Kept(k) => Lineage::Kept(k.clone()),
            MapInput::Stream(_) => Lineage::DriverStream,
        };
        let events = self.clone();
        tokio::spawn(async move {
            events.event("task_start", || {
                serde_json::json!({"shuffle": shuffle.to_string(), "map": map, "attempt": attempt, "worker": worker})
            });
            let done: Result<MapDone> = async move {
                // A lost worker's replacement learns of the shuffle first.
                me.register_replaced(shuffle).await?;
                let client = me.worker(worker)?;
                let result = match input {
                    MapInput::Source(source) => {
                        let task = proto::MapTask {
                            source: Some(source),
                            ..task
                        };
                        client.run_map(&task).await
                    }
                    MapInput::Stream(stream) => {
                        let schema = me.shuffle_schema(shuffle)?;
                        client.put_map(&task, schema, stream).await
                    }
                    MapInput::Kept(kept) => {
                        let schema = me.shuffle_schema(shuffle)?;
                        client.put_map(&task, schema, kept.stream()).await
                    }
                };
                let cancel = proto::CommitTask {
                    shuffle_id: shuffle.0,
                    map_id: map,
                    attempt,
                    blocks: 0,
                    merged_maps: vec![],
                };
                let result = match result {
                    Ok(r) => r,
                    Err(e) => {
                        if pushes {
                            me.cancel_on(&holders, &cancel).await;
                        }
                        return Err(me.classify(e).await);
                    }
                };
                // Claiming, committing and recording run to their end even when the attempt's
                // caller is dropped (its job failed elsewhere), so the driver's records always
                // match what the workers committed: recovery relies on it ([`Driver::settle`]).
                let committing = me.committing.clone().read_owned().await;
                let inner = tokio::spawn(async move {
                    let _committing = committing;
                    // An attempt of a run before a restart (below the floor) never claims.
                    let claimed = me.update_shuffle(shuffle, |e| {
                        attempt >= e.floor.get(&map).copied().unwrap_or(0)
                            && *e.claims.entry(map).or_insert(attempt) == attempt
                    });
                    if !claimed {
                        // Another attempt of this map finished first: this one's blocks go.
                        me.cancel_on(&holders, &cancel).await;
                        return Err(Error::Superseded {
                            map,
                            attempt,
                            worker,
                        });
                    }
                    // Commit on every worker holding blocks of the attempt: where it ran, and where
                    // it pushed blocks to.
                    let mut commits = vec![(worker, result.blocks.len() as u32)];
                    for p in &result.pushed {
                        if p.worker as usize >= n || p.worker as usize == worker {
                            me.update_shuffle(shuffle, |e| e.claims.remove(&map));
                            me.cancel_on(&holders, &cancel).await;
                            return Err(Error::Cluster(format!(
                                "map {map} reported blocks pushed to worker {} (cluster of {n})",
                                p.worker
                            )));
                        }
                        commits.push((p.worker as usize, p.blocks.len() as u32));
                    }
                    // Stored: the map's object holds every block (a holder lost mid-commit
                    // is restored from it).
                    let stored = me.is_durable(shuffle)
                        && result.object.as_ref().is_some_and(|o| !o.path.is_empty());
                    me.commit_on_holders(&commits, &cancel, false, stored)
                        .await?;
                    // The committed attempt's lineage (a speculative copy that lost leaves none).
                    // Every process holding a block of it: where it ran, where it pushed to (the
                    // slots' generations when the map was submitted: a replacement since holds
                    // nothing of it).
                    let mut holders = vec![(worker, generation)];
                    for p in &result.pushed {
                        let slot = p.worker as usize;
                        holders.push((slot, generations.get(slot).copied().unwrap_or(u64::MAX)));
                    }
                    let rows = (partitions > 0
                        && result.partition_rows.len() == partitions as usize)
                        .then(|| Arc::from(result.partition_rows.as_slice()));
                    me.update_shuffle(shuffle, |e| {
                        e.outputs.insert(
                            map,
                            Made {
                                worker,
                                holders,
                                rows,
                                lineage,
                                object: result.object.clone(),
                            },
                        )
                    });
                    let mut blocks = me.record_blocks(shuffle, worker, &result, &[])?;
                    for p in &result.pushed {
                        let pushed = proto::TaskResult {
                            blocks: p.blocks.clone(),
                            ..Default::default()
                        };
                        blocks.extend(me.record_blocks(
                            shuffle,
                            p.worker as usize,
                            &pushed,
                            &[],
                        )?);
                    }
                    me.record_coded(shuffle, map, attempt, generations, &mut blocks);
                    Ok(MapDone {
                        map,
                        attempt,
                        worker,
                        blocks,
                        input: Checksum {
                            rows: result.input_rows,
                            sum: result.input_checksum,
                        },
                        input_bytes: result.input_bytes,
                        spilled_bytes: result.spilled_bytes,
                        admission_wait_seconds: result.admission_wait_seconds,
                        committed_at: std::time::Instant::now(),
                    })
                });
                inner
                    .await
                    .map_err(|e| Error::Cluster(format!("committing map {map} failed: {e}")))?
            }
            .await;
            if let Ok(d) = &done {
                events.progress.committed(d);
            }
            events.event("task_end", || {
                task_end(shuffle, map, attempt, worker, &done)
            });
            done
        })
    }

    pub(super) fn shuffle_schema(&self, shuffle: ShuffleId) -> Result<SchemaRef> {
        self.with_shuffle(shuffle, |e| e.schema.as_ref().map(|(s, _)| s.clone()))
            .flatten()
            .ok_or(Error::UnknownShuffle(shuffle))
    }
}

/// The `task_end` event of a map attempt: rows, bytes and spill, or its error.
fn task_end(
    shuffle: ShuffleId,
    map: u32,
    attempt: u32,
    worker: usize,
    done: &Result<MapDone>,
) -> serde_json::Value {
    let mut f = serde_json::json!({
        "shuffle": shuffle.to_string(), "map": map, "attempt": attempt, "worker": worker,
        "ok": done.is_ok(),
    });
    match done {
        Ok(d) => {
            f["rows"] = d.input.rows.into();
            f["bytes"] = d.blocks.iter().map(|b| b.meta.bytes).sum::<u64>().into();
            f["spilled_bytes"] = d.spilled_bytes.into();
            f["admission_wait_s"] = d.admission_wait_seconds.into();
        }
        Err(e) => f["error"] = e.to_string().into(),
    }
    f
}
